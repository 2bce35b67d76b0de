// Workers & health page: refreshes from GET /api/workers every 5 s (workers have no live event group)
// and rebuilds the services strip, the worker cards and the queue table with the markup workers.html
// renders first. Heartbeat ages tick every second on the server's clock, not the browser's.
(function () {
  "use strict";

  const REFRESH_MS = 5000;
  const DATABASE_NAMES = { sqlite: "SQLite", postgresql: "PostgreSQL", mysql: "MySQL" }; // as the view names them
  const e = (value) => mi.escapeHtml(value ?? "");

  function levelOf(percent, root) {
    if (percent >= Number(root.dataset.highPercent)) return "high";
    return percent >= Number(root.dataset.warnPercent) ? "warn" : "ok";
  }

  function meter(label, text, percent, level, ariaLabel) {
    const shown = Math.max(0, Math.min(100, percent));
    return `<div class="meter-line"><span>${e(label)}</span><span${label === "Model budget" ? "" : ' data-testid="memory-text"'}>${e(text)}</span></div>
      <div class="bar memory level-${level}" role="meter" aria-label="${e(ariaLabel)}" aria-valuemin="0" aria-valuemax="100"
        aria-valuenow="${Math.round(shown)}"><span style="width: ${shown.toFixed(1)}%"></span></div>`;
  }

  function renderHealth(data) {
    const queued = data.queues.reduce((sum, queue) => sum + queue.queued, 0);
    const running = data.queues.reduce((sum, queue) => sum + queue.running, 0);
    const redisDown = data.redis.ok ? "" : `<p class="notice error" role="alert" data-testid="redis-down"><strong>Redis is unreachable.</strong>
      Workers, queues and live updates are unavailable until it answers again: check <code>REDIS_URL</code>, or run
      <code>python manage.py serve</code>, which starts an embedded Redis.</p>`;
    const database = data.database.ok
      ? '<span class="badge status-ready">reachable</span>'
      : '<span class="badge status-failed">unreachable</span>';
    const vendor = DATABASE_NAMES[data.database.vendor] || data.database.vendor;
    return `${redisDown}
      <div class="health-item" data-testid="redis-status"><span class="label">Redis</span>
        ${data.redis.ok ? '<span class="badge status-ready">reachable</span>' : '<span class="badge status-failed">unreachable</span>'}
        <span class="sub">queues, heartbeats, live events</span></div>
      <div class="health-item" data-testid="database-status"><span class="label">Database</span>${database}
        <span class="sub">${e(vendor)}</span></div>
      <div class="health-item"><span class="label">Workers</span><strong data-testid="worker-count">${data.workers.length}</strong></div>
      <div class="health-item"><span class="label">Jobs</span><strong data-testid="job-totals">${queued} waiting · ${running} running</strong></div>`;
  }

  function renderWorker(beat, data, root) {
    const total = beat.memory_total_bytes || 0;
    const used = Math.max(total - (beat.memory_free_bytes || 0), 0);
    const usedPercent = total ? 100 * used / total : 0;
    const modelsBytes = beat.loaded_models.reduce((sum, entry) => sum + (entry.memory_usage_bytes || 0), 0);
    const limit = beat.memory_limit_bytes || 0;
    const budgetPercent = limit ? Math.min(100 * modelsBytes / limit, 100) : 0;
    const age = Math.max(data.server_time - beat.last_heartbeat, 0);
    const late = age > 2 * Number(root.dataset.heartbeatSeconds);
    const own = data.queues.find((queue) => queue.kind === "worker" && queue.worker === beat.name) || { queued: 0, running: 0 };
    const models = beat.loaded_models.length
      ? `<ul class="loaded-models">${beat.loaded_models.map((entry) => `<li>
          <a href="${e(root.dataset.modelUrl.replace("MODEL_ID", encodeURIComponent(entry.model_id)))}">${e(entry.name || entry.model_id)}</a>
          <span class="mem">${e(mi.bytes(entry.memory_usage_bytes))}</span>
          <span class="meta">${entry.quantization === "none" ? "not quantized" : e(entry.quantization)} · idle ${e(mi.duration(entry.idle_seconds || 0))}</span></li>`).join("")}</ul>`
      : '<p class="muted small" style="margin: 0">No model loaded.</p>';
    const budget = limit
      ? meter("Model budget", `${mi.bytes(modelsBytes)} / ${mi.bytes(limit)}`, budgetPercent, levelOf(budgetPercent, root), "Model memory budget used")
      : "";
    const status = late
      ? `<span class="badge status-late" title="No heartbeat for ${e(mi.duration(age))}">late</span>`
      : '<span class="badge status-online">online</span>';
    return `<article class="card worker-card" data-worker="${e(beat.name)}">
      <div class="card-head"><h2>${e(beat.name)}</h2>${status}</div>
      <div class="worker-sub"><span class="device" data-testid="device">${e(beat.device)}</span>
        <span>${e(beat.hostname)}</span><span>pid ${e(beat.pid)}</span><span>up ${e(mi.duration(data.server_time - beat.started_at))}</span></div>
      <div>${meter(beat.device === "cpu" ? "Machine memory" : "GPU memory",
        `${mi.bytes(used)} / ${mi.bytes(total)} · ${Math.round(usedPercent)} %`, usedPercent, levelOf(usedPercent, root),
        `Memory used on ${beat.device}`)}${budget}</div>
      <h3>Loaded models</h3>${models}
      <dl class="stats"><dt>Own queue</dt><dd data-testid="own-queue">${own.queued} waiting · ${own.running} running</dd>
        <dt>Last heartbeat</dt><dd data-heartbeat="${e(beat.last_heartbeat)}">${e(mi.duration(age))} ago</dd></dl>
    </article>`;
  }

  function renderWorkers(data, root) {
    if (data.workers.length) return `<div class="cards">${data.workers.map((beat) => renderWorker(beat, data, root)).join("")}</div>`;
    if (!data.redis.ok) return '<div class="empty"><strong>Workers cannot be seen</strong><p>Their heartbeats live in Redis, which is unreachable.</p></div>';
    return `<div class="empty" data-testid="no-workers"><strong>No worker is running</strong>
      <p>Models load and jobs run in worker processes. Start one with <code>python manage.py worker</code></p>
      <p class="small">Add <code>--device cuda:0</code> for a GPU, and one per device; <code>python manage.py serve</code> starts web and a worker together.</p></div>`;
  }

  function renderQueues(data) {
    if (!data.queues.length) {
      return `<p class="muted small" style="margin: .6rem">No queue to show${data.redis.ok ? "" : ": Redis is unreachable"}.</p>`;
    }
    const rows = data.queues.map((queue) => `<tr data-queue="${e(queue.name)}">
      <td><code class="queue-name">${e(queue.name)}</code></td>
      <td>${queue.kind === "shared" ? 'every worker <span class="muted small">(model loads)</span>'
        : `<code>${e(queue.worker)}</code>${queue.worker_alive ? "" : ' <span class="badge status-gone">gone</span>'}`}</td>
      <td class="num${queue.queued ? " has-jobs" : ""}" data-testid="queued">${queue.queued}</td>
      <td class="num">${queue.running}</td>
      <td class="num${queue.failed ? " has-failed" : ""}">${queue.failed}</td></tr>`).join("");
    return `<table class="grid"><thead><tr><th scope="col">Queue</th><th scope="col">Consumed by</th>
      <th scope="col" class="num">Waiting</th><th scope="col" class="num">Running</th><th scope="col" class="num">Failed</th></tr></thead>
      <tbody>${rows}</tbody></table>`;
  }

  document.addEventListener("DOMContentLoaded", () => {
    const root = document.getElementById("workers-page");
    if (!root) return;
    const refreshed = document.getElementById("refreshed");
    const button = document.getElementById("refresh");
    let serverOffset = 0; // server clock minus browser clock, from the last answer
    let lastOk = null;
    let inFlight = false;

    async function refresh() {
      if (inFlight) return;
      inFlight = true;
      try {
        const data = await mi.api("GET", "workers");
        serverOffset = data.server_time - Date.now() / 1000;
        document.getElementById("health").innerHTML = renderHealth(data);
        document.getElementById("worker-list").innerHTML = renderWorkers(data, root);
        document.getElementById("queue-list").innerHTML = renderQueues(data);
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
      root.querySelectorAll("[data-heartbeat]").forEach((node) => {
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
    // The first answer gives the server's clock for the ages (the page was rendered with it too).
    refresh();
  });
})();
