// The group form follows the model chosen: its suggestion line and placeholders come from the JSON
// of every model's suggestion the form carries (data-suggestions) (the service's own defaults), and "one transcoder per
// layer" fills the transcoders with the chosen model's layers.
(() => {
  const form = document.getElementById("group-form");
  const model = document.getElementById("group-model");
  if (!form || !form.dataset.suggestions || !model) return;
  const suggestions = JSON.parse(form.dataset.suggestions);
  const hooks = document.getElementById("group-hooks");
  let shownHook = suggestions[model.value]?.hook || "";

  const words = (s) =>
    `Suggested for ${s.name} (d_in ${s.d_in}): TopK, ${s.expansion}× = ${s.d_sae} features, k ${s.k}, ` +
    `${s.tokens.toLocaleString("en")} tokens` +
    (s.minutes !== null ? `: about ${s.minutes} min on ${s.device} (${s.rate})` : "");

  function follow() {
    const s = suggestions[model.value];
    const line = document.getElementById("group-suggestion");
    if (line) line.textContent = s ? words(s) : "";
    if (!s) return;
    document.getElementById("group-k").placeholder = s.k;
    document.getElementById("group-tokens").placeholder = s.tokens;
    document.querySelectorAll('[data-suggest="k_rule"]').forEach((node) => { node.textContent = s.k_rule; });
    if (hooks && (hooks.value.trim() === "" || hooks.value.trim() === shownHook)) hooks.value = s.hook;
    shownHook = s.hook;
    const analyze = document.getElementById("group-analyze");
    if (analyze && !analyze.dataset.touched) analyze.checked = s.analyze_members;
  }

  model.addEventListener("change", follow);
  document.getElementById("group-analyze")?.addEventListener("change", (event) => {
    event.target.dataset.touched = "1";
  });
  document.getElementById("group-transcoder-per-layer")?.addEventListener("click", () => {
    const s = suggestions[model.value];
    if (!s) return;
    document.getElementById("group-transcoders").value = s.transcoders;
    if (hooks && hooks.value.trim() === shownHook) hooks.value = "";
  });
})();
