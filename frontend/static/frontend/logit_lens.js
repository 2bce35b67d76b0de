// The logit-lens page: posts the prompt to POST /api/models/{id}/logit-lens and fills a table of
// layers x positions; each cell shows the top-1 next token and its probability (shaded by it), and
// its other top tokens on hover or keyboard focus.
(function () {
  "use strict";

  const form = document.getElementById("lens-form");
  if (!form) return;
  const $ = (id) => document.getElementById(id);
  const submit = $("lens-submit"), state = $("lens-state"), table = $("lens-table");
  const percent = (p) => `${(100 * p).toFixed(p >= 0.1 ? 0 : 1)} %`;

  function headCell(text, position) {
    const th = document.createElement("th");
    th.scope = "col";
    th.className = "token-head";
    const token = document.createElement("span");
    token.className = "mono token-text";
    token.textContent = text;
    const index = document.createElement("small");
    index.textContent = position;
    th.append(token, index);
    return th;
  }

  function lensCell(layer, position, input, entries) {
    const td = document.createElement("td");
    const best = entries[0];
    td.className = "lens-cell";
    td.tabIndex = 0;
    td.style.setProperty("--alpha", (0.85 * best.probability).toFixed(3));
    td.setAttribute("aria-label", `Layer ${layer}, after ${JSON.stringify(input)} (position ${position}): ` +
      entries.map((entry) => `${JSON.stringify(entry.token)} ${percent(entry.probability)}`).join(", "));
    const token = document.createElement("span");
    token.className = "lens-token";
    token.textContent = mi.visibleToken(best.token);
    const probability = document.createElement("span");
    probability.className = "lens-probability";
    probability.textContent = percent(best.probability);
    const others = document.createElement("div");
    others.className = "lens-others";
    others.setAttribute("aria-hidden", "true");  // the cell's label already reads them out
    const list = document.createElement("ol");
    for (const entry of entries) {
      const item = document.createElement("li");
      const text = document.createElement("span");
      text.className = "mono";
      text.textContent = mi.visibleToken(entry.token);
      item.append(text, ` ${percent(entry.probability)}`);
      list.appendChild(item);
    }
    others.appendChild(list);
    td.append(token, probability, others);
    return td;
  }

  function draw(result) {
    const head = document.createElement("thead"), headRow = document.createElement("tr");
    const corner = document.createElement("th");
    corner.scope = "col";
    corner.textContent = "Layer";
    headRow.appendChild(corner);
    result.tokens.forEach((token, position) => headRow.appendChild(headCell(mi.visibleToken(token), String(position))));
    head.appendChild(headRow);
    const rows = document.createElement("tbody");
    result.layers.forEach((layer, row) => {
      const tr = document.createElement("tr");
      const th = document.createElement("th");
      th.scope = "row";
      th.textContent = `Layer ${layer}`;
      tr.appendChild(th);
      result.top[row].forEach((entries, position) => tr.appendChild(lensCell(layer, position, result.tokens[position], entries)));
      rows.appendChild(tr);
    });
    table.replaceChildren(head, rows);
    $("lens-result").hidden = false;
  }

  mi.workerForm(form, {
    submit, state, errorId: "lens-error", draw,
    request: () => {
      const top = Number(form.elements.top.value) || 5;
      return mi.api("POST", `models/${encodeURIComponent(form.dataset.modelId)}/logit-lens`, { prompt: form.elements.prompt.value, top });
    },
  });
})();
