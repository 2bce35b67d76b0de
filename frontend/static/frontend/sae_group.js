// An SAE group's page: while the group is queued or running, fetch its changing part again
// (`?fragment=live`, rendered by the server with the template of the first load) every 2 s.
(function () {
  "use strict";
  const live = document.getElementById("group-live");
  if (!live) return;
  async function refresh() {
    if (!live.hasAttribute("data-active")) return;
    try {
      const response = await fetch("?fragment=live", { headers: { "X-Requested-With": "fetch" } });
      if (response.ok) {
        live.innerHTML = await response.text();
        const status = live.querySelector("#group-status");
        const active = status && ["queued", "running"].includes(status.dataset.status);
        live.toggleAttribute("data-active", Boolean(active));
        const cancel = document.getElementById("cancel-group-form");
        if (cancel && !active) cancel.hidden = true;
        document.dispatchEvent(new CustomEvent("mistudio:content"));
      }
    } catch (_) { /* the next poll tries again */ }
    setTimeout(refresh, 2000);
  }
  setTimeout(refresh, 2000);
})();
