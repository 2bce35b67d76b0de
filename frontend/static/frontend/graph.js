// The attribution-graph explorer: draws GET /api/graphs/{id}/nodes (the graph pruned at the
// thresholds, in the Neuronpedia graph JSON) as an SVG: one column per prompt position, one row per
// layer (token embeddings at the bottom, logits on top), edges coloured by sign (blue excites, red
// inhibits) with their width by |weight|. Hover shows a node; click selects it (its label,
// explanation, activation, influence, dashboard link), pins it (PATCH pinned), or intervenes on it
// (POST /intervene: the new top logits). Pinned features group into named supernodes (PATCH
// supernodes); "the pinned nodes only" shows their subgraph. The threshold sliders prune live and
// are saved as the graph's own; the node slider reaches the widest threshold the graph's bounded
// view holds (mistudio.max_node_threshold: 1 unless the graph is large). Waits for the job (live_fragment.js) when the graph is not done yet.
(function () {
  "use strict";

  const explorer = document.getElementById("graph-explorer");
  if (!explorer) return;
  const $ = (id) => document.getElementById(id);
  const graphId = explorer.dataset.graphId;
  const canChange = explorer.dataset.canChange === "1";
  const svg = $("graph-svg");
  const SVG = "http://www.w3.org/2000/svg";
  const state = { view: null, selected: null, pinned: [], supernodes: [], subgraph: false, ticket: 0, annotations: {} };
  // A saved subgraph read through ?subgraph=: its pins, supernodes, thresholds and notes; changes
  // go to it (its owner's), not to the graph row.
  const subgraphId = new URLSearchParams(window.location.search).get("subgraph");
  let thresholdsFromView = Boolean(subgraphId);
  let started = false, reloadTimer = null;

  const number = (value, digits = 3) => (value === null || value === undefined ? "—" : Number(value).toFixed(digits));
  const isFeature = (node) => node.feature_type === "cross layer transcoder";
  const featureKey = (node) => `${node.layer}_${node.node_id.split("_")[1]}`;
  const featureIndex = (node) => Number(node.node_id.split("_")[1]);

  function element(name, attributes, parent) {
    const node = document.createElementNS(SVG, name);
    for (const [key, value] of Object.entries(attributes)) node.setAttribute(key, value);
    if (parent) parent.append(node);
    return node;
  }

  // Rows: the token embeddings 0, layer L's features and errors L + 1, the logits layers + 1 (the
  // JSON's "layer" of a logit is already layers + 1).
  function rowOf(node, layers) {
    if (node.layer === "E") return 0;
    if (node.feature_type === "logit") return layers + 1;
    return Number(node.layer) + 1;
  }

  function draw() {
    const view = state.view;
    if (!view) return;
    const layers = view.mistudio.layers;
    let nodes = view.nodes, links = view.links;
    if (state.subgraph && state.pinned.length) {
      const keep = new Set(state.pinned);
      nodes = nodes.filter((node) => keep.has(node.node_id));
      links = links.filter((link) => keep.has(link.source) && keep.has(link.target));
    }
    const positions = view.metadata.prompt_tokens.length;
    const rows = layers + 2;
    const cells = new Map();
    for (const node of nodes) {
      const key = `${rowOf(node, layers)}:${node.ctx_idx}`;
      if (!cells.has(key)) cells.set(key, []);
      cells.get(key).push(node);
    }
    // Each cell (a layer at a position) lays its nodes out on a grid, the most influential first,
    // so that no two overlap however many features fire there; a position is as wide as its
    // widest cell needs (a position with only its token stays narrow).
    const step = 15, perRow = 12, left = 34, top = 20;
    const across = new Array(positions).fill(1);
    for (const [key, cell] of cells) {
      const column = Number(key.split(":")[1]);
      across[column] = Math.max(across[column], Math.min(perRow, cell.length));
    }
    // A column is as wide as its token's text (up to 24 characters: longer ones are cut, whole on hover).
    const tokenWidth = (column) => 8 + 7 * Math.min(24, view.metadata.prompt_tokens[column].length);
    const widths = across.map((count, column) => Math.max(48, step * count + 16, tokenWidth(column)));
    const starts = widths.map((_, column) => left + widths.slice(0, column).reduce((sum, w) => sum + w, 0));
    const tallest = Math.max(1, ...[...cells.values()].map((cell) => Math.ceil(cell.length / perRow)));
    const rowHeight = Math.max(70, step * tallest + 30);
    const width = left + widths.reduce((sum, w) => sum + w, 0) + 10, height = top * 2 + rowHeight * rows + 30;
    svg.replaceChildren();
    svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
    svg.setAttribute("width", width);
    svg.setAttribute("height", height);
    const place = new Map();
    for (const [key, cell] of cells) {
      const [row, column] = key.split(":").map(Number);
      cell.sort((a, b) => (a.influence ?? 1) - (b.influence ?? 1));
      const wide = Math.min(perRow, cell.length), down = Math.ceil(cell.length / perRow);
      cell.forEach((node, index) => {
        const x = starts[column] + widths[column] / 2 + ((index % perRow) - (wide - 1) / 2) * step;
        const y = top + (rows - 1 - row) * rowHeight + rowHeight / 2 + (Math.floor(index / perRow) - (down - 1) / 2) * step;
        place.set(node.node_id, { x, y, node });
      });
    }
    // Row labels and the prompt's tokens under their columns.
    for (let row = 0; row < rows; row++) {
      const label = row === 0 ? "emb" : row === rows - 1 ? "logit" : `L${row - 1}`;
      element("text", { x: 2, y: top + (rows - 1 - row) * rowHeight + 12, class: "row-label" }, svg).textContent = label;
    }
    view.metadata.prompt_tokens.forEach((token, column) => {
      const text = element("text", { x: starts[column] + widths[column] / 2, y: height - 8, class: "token-label", "text-anchor": "middle" }, svg);
      const fits = Math.max(3, Math.floor((widths[column] - 8) / 7));
      text.textContent = token.length > fits ? token.slice(0, fits - 1) + "…" : token;
      text.append(element("title", {}));
      text.lastChild.textContent = `position ${column}: ${token}`;
    });
    const heaviest = Math.max(1e-9, ...links.map((link) => Math.abs(link.weight)));
    const edges = element("g", { class: "edges" }, svg);
    for (const link of links) {
      const from = place.get(link.source), to = place.get(link.target);
      if (!from || !to) continue;
      const strength = Math.abs(link.weight) / heaviest;
      element("line", {
        x1: from.x, y1: from.y, x2: to.x, y2: to.y, class: `edge ${link.weight >= 0 ? "pos" : "neg"}`,
        "stroke-width": (0.4 + 4 * strength).toFixed(2), "stroke-opacity": (0.15 + 0.7 * strength).toFixed(2),
        "data-source": link.source, "data-target": link.target,
      }, edges);
    }
    const pinned = new Set(state.pinned);
    const grouped = new Map();
    state.supernodes.forEach(([name, ...ids]) => ids.forEach((id) => grouped.set(id, name)));
    // Supernodes: a box around their members, named.
    const hulls = element("g", { class: "supernodes" }, svg);
    for (const [name, ...ids] of state.supernodes) {
      const members = ids.map((id) => place.get(id)).filter(Boolean);
      if (!members.length) continue;
      const xs = members.map((member) => member.x), ys = members.map((member) => member.y);
      const x = Math.min(...xs) - 11, y = Math.min(...ys) - 11;
      element("rect", { x, y, width: Math.max(...xs) - x + 11, height: Math.max(...ys) - y + 11, rx: 8, class: "supernode", "data-supernode": name }, hulls);
      element("text", { x: x + 2, y: y - 3, class: "supernode-label" }, hulls).textContent = name;
    }
    const group = element("g", { class: "nodes" }, svg);
    const labelled = new Set(labelledNodes([...place.values()].map((entry) => entry.node)));
    const labels = element("g", { class: "node-labels" }, svg);
    for (const { x, y, node } of place.values()) {
      const shape = isFeature(node) ? "circle" : "rect";
      const classes = ["node", node.feature_type.replace(/ /g, "-")];
      if (pinned.has(node.node_id)) classes.push("pinned");
      if (grouped.has(node.node_id)) classes.push("grouped");
      if (state.selected === node.node_id) classes.push("selected");
      const attributes = shape === "circle" ? { cx: x, cy: y, r: 6 } : { x: x - 6, y: y - 6, width: 12, height: 12, rx: 2 };
      const mark = element(shape, { ...attributes, class: classes.join(" "), tabindex: 0, "data-node-id": node.node_id, role: "button", "aria-label": describe(node) }, group);
      mark.addEventListener("mouseenter", () => tooltip(node, x, y));
      mark.addEventListener("mouseleave", () => ($("graph-tooltip").hidden = true));
      mark.addEventListener("focus", () => tooltip(node, x, y));
      mark.addEventListener("click", () => select(node));
      mark.addEventListener("keydown", (event) => { if (event.key === "Enter") select(node); });
      if (labelled.has(node.node_id)) {
        const text = shortName(node);
        const label = element("text", { x: x + 8, y: y + 3, class: "node-name" }, labels);
        label.textContent = text.length > 18 ? text.slice(0, 17) + "…" : text;
      }
    }
    $("graph-counts").textContent = `${nodes.length} nodes, ${links.length} edges shown`;
    if (!state.scrolled) {  // the last positions (the logits' side) in view first
      state.scrolled = true;
      $("graph-canvas").scrollLeft = $("graph-canvas").scrollWidth;
    }
  }

  // The feature's name as a reader would write it: a label, else its explanation, else the analysis's
  // automatic one (marked), else nothing.
  function shortName(node) {
    if (!isFeature(node)) return "";
    const name = state.view.mistudio.features[featureKey(node)];
    return node.clerp || (name && (name.label || name.explanation || (name.auto_label && `auto: ${name.auto_label}`))) || "";
  }

  // The feature nodes named on the canvas: the pinned ones and the most influential named ones
  // (at most 30, and none at a position whose cell is crowded), so that names do not cover each other.
  function labelledNodes(nodes) {
    const named = nodes.filter((node) => isFeature(node) && shortName(node));
    named.sort((a, b) => (a.influence ?? 1) - (b.influence ?? 1));
    const chosen = new Set(named.filter((node) => state.pinned.includes(node.node_id)).map((node) => node.node_id));
    const perCell = new Map();
    for (const node of named) {
      const cell = `${node.layer}:${node.ctx_idx}`;
      if (chosen.size >= 30) break;
      if ((perCell.get(cell) || 0) >= 2) continue;
      perCell.set(cell, (perCell.get(cell) || 0) + 1);
      chosen.add(node.node_id);
    }
    return chosen;
  }

  function describe(node) {
    if (isFeature(node)) {
      const text = shortName(node);
      return `Layer ${node.layer} feature ${featureIndex(node)} at position ${node.ctx_idx}${text ? `: ${text}` : ""}`;
    }
    if (node.feature_type === "embedding") return `Token “${state.view.metadata.prompt_tokens[node.ctx_idx]}” at position ${node.ctx_idx}`;
    if (node.feature_type === "logit") return node.clerp;
    return `Error of layer ${node.layer} at position ${node.ctx_idx}`;
  }

  function tooltip(node, x, y) {
    const tip = $("graph-tooltip");
    tip.textContent = describe(node) + (node.activation != null ? ` · activation ${number(node.activation)}` : "");
    const box = svg.getBoundingClientRect(), scale = box.width / Number(svg.getAttribute("width"));
    tip.style.left = `${x * scale + 12}px`;
    tip.style.top = `${y * scale + 12}px`;
    tip.hidden = false;
  }

  function select(node) {
    state.selected = node.node_id;
    const card = $("node-card");
    card.hidden = false;
    card.dataset.nodeId = node.node_id;
    $("node-title").textContent = isFeature(node) ? `Layer ${node.layer} · feature ${featureIndex(node)} · position ${node.ctx_idx}` : describe(node);
    const name = isFeature(node) ? state.view.mistudio.features[featureKey(node)] : null;
    $("node-label").textContent = name ? [name.label || (!name.explanation && name.auto_label ? `auto: ${name.auto_label}` : ""), name.explanation && name.explanation !== name.label ? `explanation: ${name.explanation}${name.score != null ? ` (score ${number(name.score)})` : ""}` : ""].filter(Boolean).join(" · ") : "";
    $("node-facts").textContent = [node.activation != null ? `activation ${number(node.activation)}` : "", node.influence != null ? `cumulative influence ${number(node.influence)}` : "", node.token_prob ? `p ${number(node.token_prob)}` : ""].filter(Boolean).join(" · ");
    const dashboard = $("node-dashboard");
    dashboard.hidden = !(name && name.sae_id);
    if (name && name.sae_id) dashboard.href = `/saes/${encodeURIComponent(name.sae_id)}/features/${featureIndex(node)}/`;
    const pin = $("pin-node");
    if (pin) pin.textContent = state.pinned.includes(node.node_id) ? "Unpin" : "Pin";
    $("intervene-row").hidden = !isFeature(node);
    const note = state.annotations[node.node_id] || "";
    $("node-annotation-text").hidden = !note;
    $("node-annotation-text").textContent = note ? `Note: ${note}` : "";
    if ($("annotation-row")) {
      $("annotation-row").hidden = !subgraphId;
      $("node-annotation").value = note;
    }
    featurePanel(node, name);
    draw();
  }

  // The feature's top examples and logit effects, from its dashboard, without leaving the graph.
  async function featurePanel(node, name) {
    const panel = $("node-feature");
    panel.hidden = true;
    panel.replaceChildren();
    if (!isFeature(node) || !name || !name.sae_id) return;
    const asked = node.node_id;
    let detail;
    try {
      detail = await mi.api("GET", `saes/${encodeURIComponent(name.sae_id)}/features/${featureIndex(node)}`);
    } catch (error) {
      return;  // no analysis of its transcoder yet: the card says what the graph knows
    }
    if (state.selected !== asked) return;
    const heading = (text) => Object.assign(document.createElement("h4"), { textContent: text });
    const examples = document.createElement("ol");
    examples.className = "feature-examples";
    for (const example of (detail.top_examples || []).slice(0, 4)) {
      const item = document.createElement("li");
      example.tokens.forEach((token, at) => {
        const span = document.createElement("span");
        span.textContent = token;
        if (at === example.center) span.className = "center";
        item.append(span);
      });
      item.title = `activation ${number(example.value)}`;
      examples.append(item);
    }
    panel.append(heading("Top examples"), examples);
    const effects = detail.logit_effects;
    if (effects) {
      const promoted = document.createElement("p");
      promoted.className = "mono small";
      promoted.textContent = `promotes ${effects.top.slice(0, 6).map((effect) => JSON.stringify(effect.token)).join(" ")} · suppresses ${effects.bottom.slice(0, 6).map((effect) => JSON.stringify(effect.token)).join(" ")}`;
      panel.append(heading("Logit effects"), promoted);
    }
    panel.hidden = false;
  }

  function lists() {
    const nodesById = new Map((state.view ? state.view.nodes : []).map((node) => [node.node_id, node]));
    const pinnedList = $("pinned-list");
    pinnedList.replaceChildren(...state.pinned.map((id) => {
      const item = document.createElement("li");
      item.dataset.nodeId = id;
      item.textContent = nodesById.has(id) ? describe(nodesById.get(id)) : id;
      return item;
    }));
    $("supernode-list").replaceChildren(...state.supernodes.map(([name, ...ids]) => {
      const item = document.createElement("li");
      item.dataset.supernode = name;
      item.textContent = `${name}: ${ids.length} node${ids.length === 1 ? "" : "s"}`;
      return item;
    }));
    $("intervene-pinned").hidden = !state.pinned.some((id) => nodesById.has(id) && isFeature(nodesById.get(id)));
    suggestions();
  }

  // Supernodes worth grouping, offered for one click: one feature active at several positions;
  // features of one layer that carry the same name (label, explanation or automatic label) within
  // three positions of each other; and features of one layer whose strongest edge goes to the same
  // node (one role in the circuit). None already grouped; the most influential first.
  function suggestSupernodes() {
    const grouped = new Set(state.supernodes.flatMap(([, ...ids]) => ids));
    const features = state.view.nodes.filter((node) => isFeature(node) && !grouped.has(node.node_id));
    const found = new Map();
    const add = (key, name, node) => {
      if (!found.has(key)) found.set(key, { name, nodes: [] });
      found.get(key).nodes.push(node);
    };
    const strongest = new Map();
    for (const link of state.view.links) {
      const best = strongest.get(link.source);
      if (!best || Math.abs(link.weight) > Math.abs(best.weight)) strongest.set(link.source, link);
    }
    const byId = new Map(state.view.nodes.map((node) => [node.node_id, node]));
    for (const node of features) {
      add(`feature ${featureKey(node)}`, shortName(node) || `L${node.layer} #${featureIndex(node)}`, node);
      const name = shortName(node);
      if (name) add(`name ${node.layer} ${name}`, name, node);
      const link = strongest.get(node.node_id);
      if (link && byId.has(link.target)) {
        const target = byId.get(link.target);
        const label = (shortName(target) || describe(target)).slice(0, 40);
        add(`role ${node.layer} ${link.target} ${link.weight >= 0}`, `L${node.layer} ${link.weight >= 0 ? "→" : "⊣"} ${label}`, node);
      }
    }
    const suggestions = [], taken = new Set();
    for (const [key, { name, nodes }] of found) {
      const sameFeature = !key.startsWith("name ");
      const near = nodes.filter((node, at) => nodes.some((other, at2) => at2 !== at && (sameFeature || Math.abs(other.ctx_idx - node.ctx_idx) <= 3)));
      const ids = [...new Set(near.map((node) => node.node_id))];
      if (ids.length < 2 || ids.every((id) => taken.has(id))) continue;
      ids.forEach((id) => taken.add(id));
      const weight = Math.min(...near.map((node) => node.influence ?? 1));
      suggestions.push({ name, ids, weight });
    }
    return suggestions.sort((a, b) => a.weight - b.weight).slice(0, 5);
  }

  function suggestions() {
    const list = $("supernode-suggestions");
    if (!list || !state.view) return;
    list.replaceChildren(...suggestSupernodes().map(({ name, ids }) => {
      const item = document.createElement("li");
      item.dataset.suggestion = name;
      item.append(`${name}: ${ids.length} nodes `);
      if (canChange) {
        const button = document.createElement("button");
        button.type = "button";
        button.textContent = "Group";
        button.addEventListener("click", () => save({ supernodes: [...state.supernodes, [name, ...ids]] }));
        item.append(button);
      }
      return item;
    }));
    $("suggestions-title").hidden = !list.children.length;
  }

  function logits() {
    const list = $("logit-list");
    const nodes = state.view.nodes.filter((node) => node.feature_type === "logit").sort((a, b) => b.token_prob - a.token_prob);
    list.replaceChildren(...nodes.map((node) => {
      const item = document.createElement("li");
      item.textContent = node.clerp;
      return item;
    }));
  }

  async function load() {
    const ticket = ++state.ticket;
    const query = new URLSearchParams(thresholdsFromView ? {} : { node_threshold: $("node-threshold").value, edge_threshold: $("edge-threshold").value });
    if (subgraphId) query.set("subgraph", subgraphId);
    try {
      const view = await mi.api("GET", `graphs/${encodeURIComponent(graphId)}/nodes?${query}`);
      if (ticket !== state.ticket) return;
      state.view = view;
      const slider = $("node-threshold");
      slider.max = String(view.mistudio.max_node_threshold);
      if (thresholdsFromView) {  // the subgraph's thresholds, once
        thresholdsFromView = false;
        slider.value = String(view.metadata.node_threshold);
        $("edge-threshold").value = String(view.mistudio.edge_threshold);
        $("edge-threshold-value").textContent = $("edge-threshold").value;
      }
      $("node-threshold-value").textContent = slider.value;  // (taken down to the new max)
      state.pinned = view.qParams.pinnedIds;
      state.supernodes = view.qParams.supernodes;
      draw();
      lists();
      logits();
      explorer.dataset.loaded = "1";
    } catch (error) {
      mi.toast(error.message, "error");
    }
  }

  async function save(changes) {
    if (!canChange && !subgraphId) return;
    try {
      const path = subgraphId ? `subgraphs/${encodeURIComponent(subgraphId)}` : `graphs/${encodeURIComponent(graphId)}`;
      const graph = await mi.api("PATCH", path, changes);
      state.pinned = graph.pinned;
      state.supernodes = graph.supernodes;
      if (graph.annotations) state.annotations = graph.annotations;
      lists();
      draw();
    } catch (error) {
      mi.toast(error.message, "error");
    }
  }

  async function intervene(items, what) {
    const section = $("intervention-section");
    section.hidden = false;
    $("intervention-what").textContent = `${what}: running the replacement model…`;
    try {
      const answer = await mi.api("POST", `graphs/${encodeURIComponent(graphId)}/intervene`, { interventions: items, top: 10 });
      $("intervention-what").textContent = what;
      const body = $("intervention-result").querySelector("tbody");
      body.replaceChildren(...answer.before.map((before, index) => {
        const after = answer.after[index];
        const row = document.createElement("tr");
        for (const text of [before.token, number(before.probability), after.token, number(after.probability)]) {
          const cell = document.createElement("td");
          cell.textContent = text;
          row.append(cell);
        }
        row.children[1].className = row.children[3].className = "num mono";
        return row;
      }));
      section.dataset.done = "1";
    } catch (error) {
      $("intervention-what").textContent = `${what}: ${error.message}`;
    }
  }

  function selectedNode() {
    return state.view && state.view.nodes.find((node) => node.node_id === state.selected);
  }

  function start() {
    if (started) return;
    started = true;
    explorer.hidden = false;
    for (const [slider, output] of [["node-threshold", "node-threshold-value"], ["edge-threshold", "edge-threshold-value"]]) {
      $(slider).addEventListener("input", () => {
        $(output).textContent = $(slider).value;
        clearTimeout(reloadTimer);
        reloadTimer = setTimeout(load, 200);
        // A slider explores; the graph's own thresholds change only when asked (the button).
        const saveThresholds = $("save-thresholds");
        if (saveThresholds) saveThresholds.hidden = false;
      });
    }
    $("save-thresholds")?.addEventListener("click", async () => {
      await save({ node_threshold: Number($("node-threshold").value), edge_threshold: Number($("edge-threshold").value) });
      $("save-thresholds").hidden = true;
      mi.toast("Saved as this graph's thresholds.");
    });
    $("subgraph-toggle").addEventListener("change", (event) => { state.subgraph = event.target.checked; draw(); });
    $("pin-node")?.addEventListener("click", () => {
      const id = state.selected;
      if (!id) return;
      const pinned = state.pinned.includes(id) ? state.pinned.filter((other) => other !== id) : [...state.pinned, id];
      $("pin-node").textContent = pinned.includes(id) ? "Unpin" : "Pin";
      save({ pinned });
    });
    $("group-supernode")?.addEventListener("click", () => {
      const name = $("supernode-name").value.trim();
      const byId = new Map(state.view.nodes.map((node) => [node.node_id, node]));
      const features = state.pinned.filter((id) => byId.has(id) && isFeature(byId.get(id)));
      if (!name || !features.length) return mi.toast("Pin features and name the group first.", "error");
      save({ supernodes: [...state.supernodes, [name, ...features]] });
      $("supernode-name").value = "";
    });
    const featureOf = (node, value) => ({ layer: Number(node.layer), position: node.ctx_idx, feature: featureIndex(node), value });
    $("intervene-set").addEventListener("click", () => {
      const node = selectedNode();
      const value = Number($("intervene-value").value);
      if (node) intervene([featureOf(node, value)], `Layer ${node.layer} feature ${featureIndex(node)} at ${node.ctx_idx} set to ${value}`);
    });
    $("intervene-ablate").addEventListener("click", () => {
      const node = selectedNode();
      if (node) intervene([featureOf(node, 0)], `Layer ${node.layer} feature ${featureIndex(node)} at ${node.ctx_idx} ablated`);
    });
    $("intervene-pinned").addEventListener("click", () => {
      const nodes = state.view.nodes.filter((node) => state.pinned.includes(node.node_id) && isFeature(node));
      intervene(nodes.map((node) => featureOf(node, 0)), `${nodes.length} pinned feature${nodes.length === 1 ? "" : "s"} ablated`);
    });
    $("save-subgraph")?.addEventListener("click", async () => {
      const name = $("subgraph-name").value.trim();
      if (!name) return mi.toast("Name the subgraph first.", "error");
      try {
        const saved = await mi.api("POST", `graphs/${encodeURIComponent(graphId)}/subgraphs`, {
          name, notes: $("subgraph-notes").value, shared: $("subgraph-shared").checked, pinned: state.pinned,
          supernodes: state.supernodes, node_threshold: Number($("node-threshold").value), edge_threshold: Number($("edge-threshold").value),
        });
        window.location.search = `?subgraph=${encodeURIComponent(saved.id)}`;
      } catch (error) {
        mi.toast(error.message, "error");
      }
    });
    $("annotate-node")?.addEventListener("click", () => {
      const id = state.selected;
      if (!id) return;
      const annotations = { ...state.annotations, [id]: $("node-annotation").value };
      if (!annotations[id]) delete annotations[id];
      save({ annotations }).then(() => select(selectedNode()));
    });
    subgraphs();
    load();
  }

  // The graph's saved subgraphs (links that read each), and the one read now.
  async function subgraphs() {
    try {
      const answer = await mi.api("GET", `graphs/${encodeURIComponent(graphId)}/subgraphs`);
      $("subgraph-list").replaceChildren(...answer.subgraphs.map((row) => {
        const item = document.createElement("li");
        const link = Object.assign(document.createElement("a"), { href: `?subgraph=${encodeURIComponent(row.id)}`, textContent: row.name });
        link.dataset.subgraphId = row.id;
        item.append(link, ` · ${row.owner || "system"}${row.shared ? " · shared" : ""} · `);
        item.append(Object.assign(document.createElement("a"), { href: `/api/subgraphs/${encodeURIComponent(row.id)}/export`, textContent: "Neuronpedia JSON", download: `${row.id}.json` }));
        return item;
      }));
      const reading = answer.subgraphs.find((row) => row.id === subgraphId);
      if (reading) {
        state.annotations = reading.annotations;
        $("subgraph-reading").hidden = false;
        $("subgraph-reading").textContent = `Reading the subgraph “${reading.name}”${reading.notes ? `: ${reading.notes}` : ""}. `;
        $("subgraph-reading").append(Object.assign(document.createElement("a"), { href: "?", textContent: "Back to the graph" }));
        explorer.dataset.subgraph = reading.id;
      }
    } catch (error) {
      mi.toast(error.message, "error");
    }
  }

  function maybeStart() {
    const status = document.querySelector("#graph-status[data-status]");
    if (status && status.dataset.status === "completed") start();
  }
  document.addEventListener("mistudio:content", maybeStart);
  maybeStart();
})();
