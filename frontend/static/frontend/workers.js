// Workers & health page: every 5 s the server renders the services strip, the worker cards and the
// queue table again (GET /workers/?fragment=state, the same template as the page) and this swaps
// them in; workers have no live event group. Between refreshes the heartbeat ages tick on the
// server's clock, not the browser's.
(function () {
  "use strict";

  const REFRESH_MS = 5000;

  document.addEventListener("DOMContentLoaded", () => {
    const state = document.getElementById("workers-state");
    if (!state) return;
    const refreshed = document.getElementById("refreshed");
    const button = document.getElementById("refresh");
    const serverTime = () => Number(document.getElementById("health")?.dataset.serverTime || 0);
    let serverOffset = serverTime() - Date.now() / 1000; // server clock minus browser clock
    let lastOk = null;
    let inFlight = false;

    async function refresh() {
      if (inFlight) return;
      inFlight = true;
      try {
        state.innerHTML = (await mi.fragment(`${location.pathname}?fragment=state`)).html;
        serverOffset = serverTime() - Date.now() / 1000;
        lastOk = Date.now();
        refreshed.textContent = "Updated just now";
      } catch (error) {
        refreshed.textContent = `Refresh failed: ${error.message}`;
      } finally {
        inFlight = false;
      }
    }

    // Between refreshes the heartbeat ages and the "updated" line keep counting.
    function tick() {
      const now = Date.now() / 1000 + serverOffset;
      state.querySelectorAll("[data-heartbeat]").forEach((node) => {
        node.textContent = `${mi.duration(now - Number(node.dataset.heartbeat))} ago`;
      });
      if (lastOk) {
        const seconds = Math.round((Date.now() - lastOk) / 1000);
        if (seconds >= 2 && !refreshed.textContent.startsWith("Refresh failed")) refreshed.textContent = `Updated ${seconds}s ago`;
      }
    }

    button.addEventListener("click", refresh);
    let timer = setInterval(refresh, REFRESH_MS);
    setInterval(tick, 1000);
    // A hidden tab does not poll; it catches up as soon as it is shown again.
    document.addEventListener("visibilitychange", () => {
      clearInterval(timer);
      if (!document.hidden) { refresh(); timer = setInterval(refresh, REFRESH_MS); }
    });
  });
})();
