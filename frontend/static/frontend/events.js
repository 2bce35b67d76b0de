// Live model status over /ws/events/ ("models" group); falls back to a page refresh poll when the socket drops.
(function () {
  const indicator = document.getElementById("live-indicator");
  let pollTimer = null;

  function applyModelState(state) {
    const row = document.querySelector(`tr[data-model-id="${state.model_id}"]`);
    if (!row) return;
    const badge = row.querySelector('[data-field="status"]');
    badge.textContent = state.status;
    badge.className = `badge status-${state.status}`;
    const bar = row.querySelector('[data-field="progress"]');
    bar.value = state.progress;
    bar.hidden = state.status !== "loading";
  }

  async function poll() {
    const response = await fetch("/api/models?limit=500", { credentials: "same-origin" });
    if (response.ok) (await response.json()).models.forEach((model) => applyModelState({ ...model, model_id: model.id }));
  }

  function connect() {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const socket = new WebSocket(`${scheme}://${location.host}/ws/events/`);
    socket.onopen = () => {
      indicator.classList.add("on");
      clearInterval(pollTimer);
      socket.send(JSON.stringify({ action: "subscribe", groups: ["models"] }));
    };
    socket.onmessage = (message) => {
      const payload = JSON.parse(message.data);
      if (payload.type === "snapshot" && payload.group === "models") payload.data.models.forEach(applyModelState);
      if (payload.type === "event" && payload.data.model_id) applyModelState(payload.data);
    };
    socket.onclose = () => {
      indicator.classList.remove("on");
      clearInterval(pollTimer);
      pollTimer = setInterval(poll, 5000);
      setTimeout(connect, 3000);
    };
  }
  if (indicator) connect();
})();
