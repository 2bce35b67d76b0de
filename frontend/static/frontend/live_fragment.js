// A job's page (an SAE group's training, an explanation job, a SAEBench run): while the job is queued or running,
// fetch its changing part again (`?fragment=live`, rendered by the server with the template of the
// first load) every 2 s. The part is `[data-live]` (with `data-active` while the job is), its
// status `[data-live-status]`; `[data-live-cancel]` (the cancel form) hides once the job has ended.
(function () {
  "use strict";
  const live = document.querySelector("[data-live]");
  if (!live) return;
  async function refresh() {
    if (!live.hasAttribute("data-active")) return;
    try {
      const url = new URL(window.location.href); // its own query kept (a comparison's ?run=)
      url.searchParams.set("fragment", "live");
      const response = await fetch(url, { headers: { "X-Requested-With": "fetch" } });
      if (response.ok) {
        live.innerHTML = await response.text();
        const status = live.querySelector("[data-live-status]");
        const active = status && ["queued", "running"].includes(status.dataset.status);
        live.toggleAttribute("data-active", Boolean(active));
        const cancel = document.querySelector("[data-live-cancel]");
        if (cancel && !active) cancel.hidden = true;
        document.dispatchEvent(new CustomEvent("mistudio:content"));
      }
    } catch (_) { /* the next poll tries again */ }
    setTimeout(refresh, 2000);
  }
  setTimeout(refresh, 2000);
})();
