// Playground page: POST /api/generate with "stream": true, read as server-sent events through
// fetch() + response.body.getReader() (mi.api waits for whole JSON answers, so the stream has its own
// small reader here). Stop aborts the fetch; the server hears the disconnect and cancels the generation.
// With capture on, the finished result names an activation cache, and the heatmap of one neuron over
// its tokens comes from this page's own fragment (/playground/?heatmap=<cache>&hook=&neuron=).
// With steering on, Generate sends two streamed requests with one seed (filled in when the field is
// empty): the baseline as above, and the same body with mistudio.interventions = [one SAE feature,
// or a saved steering vector added],
// whose text streams into the second pane beside it. An SAE feature's coefficient is in units of
// its max activation by default (the Unit select); both requests measure that feature on their
// output, and the steered pane shows the effect. Sweep posts /api/generate/sweep and fills a table:
// one row per coefficient with the measured effect.
(function () {
  "use strict";

  const form = document.getElementById("generate-form");
  if (!form) return; // the empty state: no ready model

  const $ = (id) => document.getElementById(id);
  const generateButton = $("generate-button"), stopButton = $("stop-button");
  const output = $("output"), outputText = $("output-text"), outputPrompt = $("output-prompt");
  const placeholder = $("output-placeholder"), caret = $("caret"), outputError = $("output-error");
  const runState = $("run-state"), liveCount = $("live-count");
  const modelSelect = $("model"), hookSelect = $("hook"), neuronInput = $("neuron"), captureBox = $("capture");
  const canWrite = form.dataset.canWrite === "true";
  const steerBox = $("steer"), steerSae = $("steer-sae"), steerIndex = $("steer-index");
  const steerAmount = $("steer-amount"), steerError = $("steer-error"), seedInput = $("seed");
  const steerVector = $("steer-vector"), steerUnit = $("steer-unit");

  const state = {
    running: false,
    controller: null,
    hooks: new Map(),      // model id -> [{name, layer, width}]
    activations: null,     // the last result's activations (cache id, hooks)
    lastResult: null,
  };

  // --- form controls --------------------------------------------------------------------------

  const mode = () => form.querySelector('input[name="mode"]:checked').value;

  function showMode() {
    for (const node of form.querySelectorAll("[data-mode]")) node.hidden = node.dataset.mode !== mode();
  }
  form.querySelectorAll('input[name="mode"]').forEach((radio) => radio.addEventListener("change", showMode));

  // Each range slider mirrors the number input that carries the name (and receives field errors).
  for (const slider of form.querySelectorAll("input[type=range][data-mirror]")) {
    const number = $(slider.dataset.mirror);
    slider.addEventListener("input", () => { number.value = slider.value; });
    number.addEventListener("input", () => { if (number.value !== "") slider.value = number.value; });
  }

  $("reset-sampling").addEventListener("click", () => {
    for (const input of form.querySelectorAll("[data-default]")) {
      input.value = input.dataset.default;
      input.dispatchEvent(new Event("input"));
    }
  });

  const DEFAULT_MAX_TOKENS = Number(form.elements.max_tokens.getAttribute("placeholder")) || 128;
  function describeModel() {
    const option = modelSelect.selectedOptions[0];
    if (!option) return;
    const quantization = option.dataset.quantization;
    const parts = [option.dataset.family, option.dataset.layers && `${option.dataset.layers} layers`,
      quantization && quantization !== "none" ? quantization : "unquantized",
      option.dataset.worker && `on ${option.dataset.worker}`];
    $("model-meta").textContent = parts.filter(Boolean).join(" · ");
    // An empty Max tokens lets the API fit the output into the context left after the prompt.
    const context = Number(option.dataset.context) || 0;
    const maxTokens = form.elements.max_tokens;
    maxTokens.placeholder = String(context ? Math.min(DEFAULT_MAX_TOKENS, context - 1) : DEFAULT_MAX_TOKENS);
    $("max-tokens-help").textContent = context
      ? `Empty: up to ${DEFAULT_MAX_TOKENS}, within the ${context}-token context after the prompt`
      : `Empty: up to ${DEFAULT_MAX_TOKENS}, within the model's context`;
  }
  modelSelect.addEventListener("change", () => { describeModel(); if (captureBox.checked) loadHooks(); offerSaes(); offerVectors(); });
  describeModel();

  // --- steering: one SAE feature, added or clamped, or a saved steering vector, added ---------------

  const steerSource = () => form.querySelector('input[name="steer_source"]:checked')?.value || "feature";
  const steering = () => steerBox.checked && Boolean(steerSource() === "vector" ? steerVector : steerSae);
  const amountField = steerAmount.closest(".field");
  const steerKind = () => form.querySelector('input[name="steer_kind"]:checked')?.value || "add";

  function showSource() {
    const vector = steerSource() === "vector";
    $("steer-feature-fields").hidden = vector;
    $("steer-vector-fields").hidden = !vector;
    describeKind();
    showSteerError("");
    showSteering();
  }

  // Vectors of the chosen model are offered (a vector has its model's width); one chosen before stays, flagged.
  function offerVectors() {
    if (!steerVector) return;
    for (const option of steerVector.options) {
      const other = option.value && option.dataset.model !== modelSelect.value;
      option.hidden = Boolean(other) && !option.selected;
    }
    describeVector();
  }

  function describeVector() {
    const option = steerVector.selectedOptions[0], meta = $("steer-vector-meta");
    if (!option || !option.value) {
      meta.textContent = "";
      return;
    }
    const elsewhere = option.dataset.model !== modelSelect.value;
    meta.textContent = [option.dataset.hook, option.dataset.width && `width ${option.dataset.width}`,
      option.dataset.norm && `norm ${option.dataset.norm}`].filter(Boolean).join(" · ")
      + (elsewhere ? ` · computed on ${option.dataset.modelName || "another model"}, not the chosen one` : "");
    meta.classList.toggle("warn-text", elsewhere);
  }

  function showSteering() {
    $("steer-fields").hidden = !steerBox.checked;
    const on = steering();
    $("output-panes").classList.toggle("split", on);
    $("steered-pane").hidden = !on;
    $("baseline-title").hidden = !on;
    if (!on) $("steer-caption").hidden = true;
  }

  // SAEs of the chosen model (or of no recorded model) are offered; one chosen before stays, flagged.
  function offerSaes() {
    if (!steerSae) return;
    for (const option of steerSae.options) {
      const other = option.value && option.dataset.model && option.dataset.model !== modelSelect.value;
      option.hidden = Boolean(other) && !option.selected;
    }
    describeSae();
  }

  function describeSae() {
    const option = steerSae.selectedOptions[0];
    const meta = $("steer-sae-meta"), link = $("steer-feature-link");
    if (!option || !option.value) {
      meta.textContent = "";
      $("steer-index-range").textContent = "";
      link.hidden = true;
      return;
    }
    const width = Number(option.dataset.width);
    const elsewhere = option.dataset.model && option.dataset.model !== modelSelect.value;
    meta.textContent = `${option.dataset.hook} · ${width} features`
      + (elsewhere ? ` · trained on ${option.dataset.modelName || "another model"}, not the chosen one` : "");
    meta.classList.toggle("warn-text", Boolean(elsewhere));
    steerIndex.max = String(width - 1);
    $("steer-index-range").textContent = `0–${width - 1}`;
    const index = steerIndex.value.trim();
    link.hidden = index === "";
    link.href = `/saes/${encodeURIComponent(option.value)}/features/${encodeURIComponent(index)}/`;
  }

  function describeKind() {
    const vector = steerSource() === "vector";
    const clamp = !vector && steerKind() === "clamp_feature";
    amountField.hidden = !vector && steerKind() === "ablate"; // an ablation takes no amount
    $("steer-amount-label").textContent = clamp ? "Value" : "Coefficient";
    const raw = !steerUnit || steerUnit.value === "raw";
    $("steer-amount-help").textContent = vector
      ? "Times the vector, added to the activation at its hook point"
      : clamp
        ? (raw ? "The feature's activation is set to this value" : "The feature's activation is set to this many times its max activation")
        : (raw ? "Times the feature's decoder row, added to the activation" : "Times the feature's max activation, along its decoder row: 1 adds what the feature writes at its strongest");
  }

  // The one intervention, or null after saying in the panel what is missing.
  function intervention() {
    if (steerSource() === "vector") return vectorIntervention();
    const option = steerSae.selectedOptions[0];
    const index = steerIndex.value.trim(), amount = steerAmount.value.trim();
    let problem = null;
    if (!option || !option.value) problem = "Choose an SAE to steer with.";
    else if (!/^\d+$/.test(index)) problem = "The feature is a whole number from 0.";
    else if (steerKind() !== "ablate" && (amount === "" || !Number.isFinite(Number(amount)))) problem = `The ${steerKind() === "clamp_feature" ? "value" : "coefficient"} must be a number.`;
    if (problem) {
      showSteerError(problem);
      return null;
    }
    if (steerKind() === "ablate") return { type: "ablate", sae: option.value, features: [Number(index)], positions: $("steer-positions").value };
    const item = { type: steerKind(), sae: option.value, feature: Number(index), positions: $("steer-positions").value, unit: steerUnit.value };
    item[item.type === "add" ? "coefficient" : "value"] = Number(amount);
    return item;
  }

  function vectorIntervention() {
    const option = steerVector.selectedOptions[0], amount = steerAmount.value.trim();
    let problem = null;
    if (!option || !option.value) problem = "Choose a steering vector.";
    else if (amount === "" || !Number.isFinite(Number(amount))) problem = "The coefficient must be a number.";
    if (problem) {
      showSteerError(problem);
      return null;
    }
    return { type: "add", steering_vector: option.value, coefficient: Number(amount), positions: $("steer-positions").value };
  }

  function showSteerError(message) {
    steerError.textContent = message;
    steerError.hidden = !message;
  }

  if (steerBox) {
    steerBox.addEventListener("change", showSteering);
    form.querySelectorAll('input[name="steer_source"]').forEach((radio) => radio.addEventListener("change", showSource));
    if (steerVector) {
      steerVector.addEventListener("change", () => { describeVector(); showSteerError(""); });
      offerVectors();
    }
    if (steerSae) {
      steerSae.addEventListener("change", () => { describeSae(); showSteerError(""); });
      steerIndex.addEventListener("input", () => { describeSae(); showSteerError(""); });
      form.querySelectorAll('input[name="steer_kind"]').forEach((radio) => radio.addEventListener("change", describeKind));
      steerUnit.addEventListener("change", () => { describeKind(); showSteerError(""); });
      offerSaes();
      describeKind();
    }
    showSteering();
  }

  // --- capture: hook points of the chosen model -------------------------------------------------------

  captureBox.addEventListener("change", () => {
    $("capture-fields").hidden = !captureBox.checked;
    if (captureBox.checked) loadHooks();
  });

  async function loadHooks() {
    const modelId = modelSelect.value;
    if (!state.hooks.has(modelId)) {
      hookSelect.disabled = true;
      hookSelect.innerHTML = "<option>Loading hook points…</option>";
      try {
        const answer = await mi.api("GET", `models/${encodeURIComponent(modelId)}/hook-points`);
        state.hooks.set(modelId, answer.hook_points.map((point) => ({ name: point.name, layer: point.layer, width: point.shape[1] })));
      } catch (error) {
        hookSelect.innerHTML = "<option>Hook points unavailable</option>";
        mi.toast(`Hook points: ${error.message}`, "error");
        return;
      }
    }
    if (modelSelect.value !== modelId) return; // the choice changed while loading
    const points = state.hooks.get(modelId);
    const previous = hookSelect.value;
    hookSelect.innerHTML = "";
    for (const point of points) {
      const option = new Option(`${point.name}  (${point.width})`, point.name);
      option.dataset.width = point.width;
      hookSelect.add(option);
    }
    // MLP neurons of the middle layer are the usual place to look first.
    const layers = points.map((point) => point.layer).filter((layer) => layer !== null && layer !== undefined);
    const middle = layers.length ? Math.floor(Math.max(...layers) / 2) : 0;
    const preferred = points.find((point) => point.name === previous)
      || points.find((point) => point.name === `blocks.${middle}.mlp.hook_post`) || points[0];
    if (preferred) hookSelect.value = preferred.name;
    hookSelect.disabled = false;
    describeNeuron();
  }

  function describeNeuron() {
    const width = Number(hookSelect.selectedOptions[0]?.dataset.width || 0);
    if (!width) return;
    neuronInput.max = String(width - 1);
    if (Number(neuronInput.value) > width - 1) neuronInput.value = String(width - 1);
    $("neuron-range").textContent = `0–${width - 1}`;
  }
  hookSelect.addEventListener("change", () => { describeNeuron(); refreshHeatmap(); });

  let neuronTimer = null;
  neuronInput.addEventListener("input", () => {
    clearTimeout(neuronTimer);
    neuronTimer = setTimeout(refreshHeatmap, 250);
  });

  // --- the request ------------------------------------------------------------------------------------

  function numberField(body, name) {
    const value = form.elements[name].value.trim();
    if (value !== "") body[name] = Number(value);
  }

  function requestBody() {
    const body = { model_id: modelSelect.value, stream: true };
    if (mode() === "chat") {
      body.messages = [{ role: "user", content: form.elements.messages.value }];
      if (form.elements.system_prompt.value.trim()) body.system_prompt = form.elements.system_prompt.value;
    } else {
      body.prompt = form.elements.prompt.value;
    }
    for (const name of ["temperature", "top_p", "top_k", "max_tokens", "repetition_penalty", "seed"]) numberField(body, name);
    // One stop sequence per line; "\n" and "\t" typed as two characters mean the control character.
    const stops = form.elements.stop.value.split("\n").filter((line) => line !== "")
      .map((line) => line.replace(/\\n/g, "\n").replace(/\\t/g, "\t"));
    if (stops.length) body.stop = stops; // more than the limit: the API's 400 names the field
    if (form.elements.ignore_eos.checked) body.ignore_eos = true;
    if (captureBox.checked && hookSelect.value && !hookSelect.disabled) {
      body.mistudio = { capture: [hookSelect.value], store: true };
    }
    return body;
  }

  // --- the stream -------------------------------------------------------------------------------------

  // Yields each server-sent event's data (parsed JSON) as the bytes arrive.
  async function* serverSentEvents(response) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          const data = block.split("\n").filter((line) => line.startsWith("data:"))
            .map((line) => line.slice(5).replace(/^ /, "")).join("\n");
          if (data) yield JSON.parse(data);
        }
      }
    } finally {
      reader.releaseLock();
    }
  }

  async function errorOf(response) {
    let body = null;
    try { body = await response.json(); } catch (_) { body = null; }
    return new mi.ApiError(response.status, body);
  }

  // Tokens arrive faster than the screen refreshes: text is buffered and drawn once per frame.
  let pending = "", frame = 0;
  function appendText(text) {
    pending += text;
    if (!frame) frame = requestAnimationFrame(flush);
  }
  function flush() {
    frame = 0;
    if (!pending) return;
    outputText.append(pending);
    pending = "";
    output.scrollTop = output.scrollHeight;
  }

  function setRunState(label, status) {
    runState.textContent = label;
    runState.className = `badge status-${status}`;
  }

  function setStat(name, value) {
    form.querySelector(`[data-stat="${name}"]`).textContent = value;
  }

  // " (CODE)" after an API error's message; nothing for a bare HTTP status.
  const codeSuffix = (error) => (error.code && !String(error.code).startsWith("HTTP_") ? ` (${error.code})` : "");

  const ms = (value) => (value === null || value === undefined ? "—" : value >= 1000 ? `${(value / 1000).toFixed(2)} s` : `${Math.round(value)} ms`);

  function resetOutput(body) {
    cancelAnimationFrame(frame);
    frame = 0;
    pending = "";
    outputText.textContent = "";
    outputPrompt.textContent = body.prompt !== undefined ? body.prompt : "";
    placeholder.hidden = true;
    outputError.hidden = true;
    for (const name of ["ttft", "rate", "prompt_tokens", "completion_tokens", "finish_reason", "total"]) setStat(name, "—");
    $("request-line").hidden = true;
    $("copy-output").disabled = true;
    $("heat-card").hidden = true;
    $("heatmap").innerHTML = "";
    state.activations = null;
  }

  function showError(error) {
    const code = error.code && error.code !== `HTTP_${error.status}` ? ` (${error.code})` : "";
    outputError.textContent = `${error.message}${code}`;
    outputError.hidden = false;
  }

  function setRunning(running) {
    state.running = running;
    generateButton.disabled = running || !canWrite;
    const sweepButton = $("sweep-button"); // one run at a time: a click while one runs would do nothing
    if (sweepButton) sweepButton.disabled = running || !canWrite;
    stopButton.disabled = !running;
    caret.hidden = !running;
    output.setAttribute("aria-busy", running ? "true" : "false");
  }

  async function generate() {
    if (state.running || !canWrite) return;
    mi.clearErrors(form);
    let steered = null;
    if (steering()) {
      showSteerError("");
      const item = intervention();
      if (!item) return;
      // One seed for both requests, so the intervention is the only difference; a seed the page
      // chose is chosen afresh next time, one the user typed is kept.
      if (seedInput.value.trim() === "" || seedInput.value === seedInput.dataset.auto) {
        seedInput.value = String(Math.floor(Math.random() * 2 ** 31));
        seedInput.dataset.auto = seedInput.value;
      }
      steered = item;
    }
    const body = requestBody();
    if (steered && steered.sae) body.mistudio = { ...(body.mistudio || {}), measure: { sae: steered.sae, feature: steered.feature ?? steered.features[0] } };
    resetOutput(body);
    setRunning(true);
    setRunState("Queued", "queued");
    const controller = new AbortController();
    state.controller = controller;
    const clicked = performance.now();
    let firstToken = null, tokens = 0, finished = false, requestId = null;
    const steeredRun = steered ? streamSteered(steeredBody(body, steered), controller.signal) : null;
    try {
      const response = await postGenerate(body, controller.signal);
      if (!response.ok) throw await errorOf(response);
      for await (const event of serverSentEvents(response)) {
        if (event.type === "started") {
          requestId = event.request_id;
          setRunState("Generating", "running");
          setStat("prompt_tokens", event.input_token_ids.length);
        } else if (event.type === "token") {
          tokens += 1;
          if (firstToken === null) {
            firstToken = performance.now();
            setStat("ttft", ms(firstToken - clicked));
          }
          appendText(event.text);
          const seconds = (performance.now() - firstToken) / 1000;
          liveCount.textContent = `${tokens} token${tokens === 1 ? "" : "s"}`;
          if (tokens > 1 && seconds > 0) setStat("rate", ((tokens - 1) / seconds).toFixed(1));
          setStat("completion_tokens", tokens);
        } else if (event.type === "done") {
          finished = true;
          finish(event, clicked);
        } else if (event.type === "error") {
          finished = true;
          flush();
          showError(new mi.ApiError(500, event));
          setRunState("Failed", "failed");
        }
      }
      if (!finished) throw new mi.ApiError(0, { error: { code: "STREAM_ENDED", message: "The stream ended before the result arrived." } });
    } catch (error) {
      flush();
      if (error.name === "AbortError") {
        setRunState("Stopped", "cancelled");
        setStat("finish_reason", "cancelled");
        if (requestId) showRequest(requestId);
      } else if (error instanceof mi.ApiError) {
        // Field messages go under their inputs; the summary goes above the output, not the form.
        mi.showErrors(form, error);
        const summary = form.querySelector(".form-error");
        let message = summary ? summary.textContent : error.message;
        if (form.querySelector(".field-error")) message += " See the highlighted fields.";
        showError({ message, code: error.code, status: error.status });
        summary?.remove();
        setRunState("Failed", "failed");
        if (!outputText.textContent && !outputPrompt.textContent) placeholder.hidden = false;
      } else {
        showError({ message: "The server cannot be reached. Your prompt is still here." });
        setRunState("Failed", "failed");
      }
    } finally {
      if (steeredRun) await steeredRun;
      setRunning(false);
      state.controller = null;
      liveCount.textContent = "";
    }
  }

  // --- the steered request: the baseline's body (seed included) plus the intervention --------------

  function steeredBody(body, item) {
    const copy = { ...body, mistudio: { interventions: [item] } }; // no capture: one cache per click
    if (item.type === "ablate") copy.mistudio.measure = { sae: item.sae, feature: item.features[0] };
    return copy;
  }

  // "feature 7 on the text 0.412 (baseline 0.031) · KL 0.52 nats · distinct-2 0.83" under the steered pane.
  function showEffect() {
    const line = $("steered-effect"), steeredEffect = state.steeredEffect, baseline = state.lastResult?.effect;
    line.hidden = !steeredEffect;
    if (!steeredEffect) return;
    const parts = [];
    if (steeredEffect.activation_mean !== null && steeredEffect.activation_mean !== undefined) {
      const before = baseline && baseline.activation_mean !== null && baseline.activation_mean !== undefined ? ` (baseline ${fixed(baseline.activation_mean)})` : "";
      parts.push(`feature ${steeredEffect.feature} on the text ${fixed(steeredEffect.activation_mean)}${before}`);
    }
    if (steeredEffect.first_token_kl !== null && steeredEffect.first_token_kl !== undefined) parts.push(`KL at the first token ${fixed(steeredEffect.first_token_kl)} nats`);
    if (steeredEffect.distinct_2 !== null && steeredEffect.distinct_2 !== undefined) parts.push(`distinct-2 ${steeredEffect.distinct_2.toFixed(2)}`);
    if (steeredEffect.error) parts.push(`not measured: ${steeredEffect.error}`);
    line.textContent = `Measured: ${parts.join(" · ")}`;
  }

  function resetSteered(body, item) {
    $("steered-text").textContent = "";
    $("steered-prompt").textContent = body.prompt !== undefined ? body.prompt : "";
    $("steered-error").hidden = true;
    $("steered-stats").textContent = "";
    state.steeredEffect = null;
    showEffect();
    const unit = item.steering_vector ? "vector" : item.unit === "raw" ? "decoder row" : "max activation";
    const amount = item.type === "add" ? `${item.coefficient >= 0 ? "+" : ""}${item.coefficient} × ${unit}`
      : item.type === "ablate" ? "ablated" : `clamped to ${item.value}${item.unit === "raw" ? "" : " × max activation"}`;
    const caption = $("steer-caption");
    const what = item.steering_vector ? `vector ${item.steering_vector}` : `feature ${item.feature ?? item.features[0]} of ${item.sae}`;
    caption.textContent = `Seed ${body.seed} for both · ${what}, ${amount}, ${item.positions} positions`;
    caption.hidden = false;
  }

  // POST /api/generate asking for its server-sent events (the baseline run and the steered one).
  function postGenerate(body, signal) {
    return fetch("/api/generate", {
      method: "POST",
      credentials: "same-origin",
      headers: {
        "Content-Type": "application/json",
        Accept: "text/event-stream",
        "X-CSRFToken": document.querySelector('meta[name="csrf-token"]')?.content || "",
      },
      body: JSON.stringify(body),
      signal,
    });
  }

  // Streams the steered text into its pane; never throws (its errors show in the pane and the panel).
  async function streamSteered(body, signal) {
    const item = body.mistudio.interventions[0];
    resetSteered(body, item);
    const text = $("steered-text"), pane = $("steered-output"), caret = $("steered-caret");
    caret.hidden = false;
    pane.setAttribute("aria-busy", "true");
    let tokens = 0;
    try {
      const response = await postGenerate(body, signal);
      if (!response.ok) throw await errorOf(response);
      for await (const event of serverSentEvents(response)) {
        if (event.type === "token") {
          tokens += 1;
          text.append(event.text);
          pane.scrollTop = pane.scrollHeight;
        } else if (event.type === "done") {
          text.textContent = event.output_text; // authoritative, as for the baseline
          const link = document.createElement("a");
          link.className = "mono";
          link.href = `/api/generations/${encodeURIComponent(event.request_id)}`;
          link.textContent = event.request_id;
          $("steered-stats").replaceChildren(`${event.usage.completion_tokens} tokens · ${event.finish_reason || "done"} · request `, link);
          state.steeredEffect = event.effect || null;
          showEffect();
          return;
        } else if (event.type === "error") {
          throw new mi.ApiError(500, event);
        }
      }
      throw new mi.ApiError(0, { error: { code: "STREAM_ENDED", message: "The stream ended before the result arrived." } });
    } catch (error) {
      if (error.name === "AbortError") {
        $("steered-stats").textContent = `${tokens} tokens · cancelled`;
        return;
      }
      const message = error instanceof mi.ApiError ? error.message : "The server cannot be reached.";
      const code = codeSuffix(error);
      $("steered-error").textContent = `${message}${code}`;
      $("steered-error").hidden = false;
      // An invalid intervention is the panel's business: say it where it can be fixed.
      if (error.code === "INVALID_INTERVENTION" || error.code === "SAE_NOT_FOUND" || error.status === 400) showSteerError(`${message}${code}`);
    } finally {
      caret.hidden = true;
      pane.setAttribute("aria-busy", "false");
    }
  }

  function finish(result, clicked) {
    flush();
    // The final result is authoritative (a stream that lost tokens still ends with the whole text).
    outputText.textContent = result.output_text;
    state.lastResult = result;
    showEffect();
    const timings = result.timings || {};
    setStat("prompt_tokens", result.usage.prompt_tokens);
    setStat("completion_tokens", result.usage.completion_tokens);
    setStat("finish_reason", result.finish_reason || "—");
    if (timings.decode_tokens_per_second) setStat("rate", timings.decode_tokens_per_second.toFixed(1));
    // From the click, as "First token" is (the worker's own time, queueing left out, in the tooltip).
    setStat("total", ms(performance.now() - clicked));
    document.querySelector('[data-stat="total"]').title = timings.total_ms !== undefined ? `on the worker: ${ms(timings.total_ms)}` : "";
    setRunState(result.finish_reason === "cancelled" ? "Stopped" : "Done", result.finish_reason === "cancelled" ? "cancelled" : "completed");
    $("copy-output").disabled = false;
    showRequest(result.request_id);
    if (result.activations) {
      state.activations = result.activations;
      $("cache-link").href = `/activations/${encodeURIComponent(result.activations.cache_id)}/`;
      $("heat-card").hidden = false;
      refreshHeatmap();
    }
  }

  function showRequest(requestId) {
    const link = $("request-link");
    link.textContent = requestId;
    link.href = `/api/generations/${encodeURIComponent(requestId)}`;
    $("request-line").hidden = false;
  }

  // --- heatmap ---------------------------------------------------------------------------------------

  let heatRequest = 0;
  async function refreshHeatmap() {
    const activations = state.activations;
    if (!activations) return;
    const target = $("heatmap");
    const hook = hookSelect.value;
    const neuron = neuronInput.value.trim() === "" ? 0 : Number(neuronInput.value);
    if (!activations.hooks.includes(hook)) {
      target.innerHTML = `<p class="notice">This result captured ${activations.hooks.map(mi.escapeHtml).join(", ")}. Generate again to capture ${mi.escapeHtml(hook)}.</p>`;
      return;
    }
    $("heat-caption").textContent = `${hook}, neuron ${neuron} · cache ${activations.cache_id} · ${activations.shapes[hook][0]} tokens`;
    const ticket = ++heatRequest;
    target.setAttribute("aria-busy", "true");
    const query = new URLSearchParams({ heatmap: activations.cache_id, hook, neuron: String(neuron) });
    try {
      const { html } = await mi.fragment(`${location.pathname}?${query}`); // a 4xx is a notice to show
      if (ticket !== heatRequest) return; // a newer neuron was asked for meanwhile
      target.innerHTML = html;
    } catch (_) {
      if (ticket === heatRequest) target.innerHTML = '<p class="notice error" role="alert">The heatmap could not be loaded.</p>';
    } finally {
      if (ticket === heatRequest) target.removeAttribute("aria-busy");
    }
  }

  // --- the strength sweep: POST /api/generate/sweep, one table row per coefficient --------------------

  const fixed = (value) => (Math.abs(value) >= 100 ? value.toFixed(0) : Math.abs(value) >= 1 ? value.toFixed(2) : value.toFixed(3));
  const sweepButton = $("sweep-button");

  function sweepCoefficients() {
    const text = $("sweep-coefficients").value.trim();
    const values = text.split(/[\s,;]+/).filter(Boolean).map(Number);
    if (!values.length || values.some((value) => !Number.isFinite(value))) return null;
    return values;
  }

  async function sweep() {
    if (state.running || !canWrite) return;
    mi.clearErrors(form);
    showSteerError("");
    const item = intervention();
    if (!item) return;
    if (item.type === "ablate") {
      showSteerError("An ablation has no strength to sweep: choose Add or Clamp.");
      return;
    }
    const coefficients = sweepCoefficients();
    if (!coefficients) {
      showSteerError("Sweep coefficients are numbers separated by commas, e.g. 0.5, 1, 2, 4.");
      return;
    }
    delete item.coefficient;
    delete item.value;
    const body = requestBody();
    delete body.stream;
    delete body.mistudio;
    if (mode() === "chat") {
      showSteerError("The sweep takes a completion prompt; switch the mode to Completion.");
      return;
    }
    Object.assign(body, { intervention: item, coefficients });
    const card = $("sweep-card"), rows = $("sweep-table").tBodies[0], error = $("sweep-error");
    card.hidden = false;
    rows.replaceChildren();
    error.hidden = true;
    $("sweep-caption").textContent = `${coefficients.length} coefficients and a baseline, one batch…`;
    $("sweep-state").textContent = "Running";
    $("sweep-state").className = "badge status-running";
    setRunning(true);
    try {
      const table = await mi.api("POST", "generate/sweep", body);
      drawSweep(table);
      $("sweep-state").textContent = "Done";
      $("sweep-state").className = "badge status-completed";
    } catch (problem) {
      error.textContent = `${problem.message}${codeSuffix(problem)}`;
      error.hidden = false;
      $("sweep-caption").textContent = "";
      $("sweep-state").textContent = "Failed";
      $("sweep-state").className = "badge status-failed";
      if (problem.status === 400 || problem.status === 404) showSteerError(error.textContent);
    } finally {
      setRunning(false);
    }
  }

  function drawSweep(table) {
    const rows = $("sweep-table").tBodies[0];
    const unit = table.unit === "max_activation" ? `× max activation ${fixed(table.unit_scale)}` : "raw";
    const what = table.intervention.steering_vector ? `vector ${table.intervention.steering_vector}` : `feature ${table.intervention.feature} of ${table.intervention.sae}`;
    const measured = table.measure ? `; measured on feature ${table.measure.feature}` : "";
    $("sweep-caption").textContent = `${what}, ${table.intervention.type === "add" ? "added" : "clamped"} (${unit}) · seed ${table.seed} for every row${measured}`;
    const peak = Math.max(
      1e-9, ...table.rows.map((row) => row.effect?.activation_mean_of_max ?? row.effect?.activation_mean ?? 0)
    );
    for (const row of table.rows) {
      const tr = document.createElement("tr");
      tr.dataset.coefficient = String(row.coefficient);
      if (row.coefficient === 0) tr.className = "baseline";
      const cell = (text, className) => {
        const td = document.createElement("td");
        if (className) td.className = className;
        td.textContent = text;
        tr.append(td);
        return td;
      };
      const effect = row.effect || {};
      cell(row.coefficient === 0 ? "baseline" : String(row.coefficient), "num");
      cell(row.coefficient === 0 ? "0" : fixed(row.raw_coefficient), "num");
      // The mean over the generated tokens in units of the feature's max activation where its
      // analysis gives one (the header says so), raw otherwise.
      const relative = effect.activation_mean_of_max !== undefined && effect.activation_mean_of_max !== null;
      const on = relative ? effect.activation_mean_of_max : effect.activation_mean;
      $("sweep-effect-unit").textContent = relative
        ? "(mean over the generated tokens, × its max activation)"
        : "(mean over the generated tokens, raw activation: no analysis gives its max)";
      const td = cell(on === null || on === undefined ? "—" : fixed(on), "effect");
      td.dataset.value = on ?? "";
      if (on !== null && on !== undefined) {
        const bar = document.createElement("span");
        bar.className = "bar";
        bar.style.width = `${Math.max(0, (100 * on) / peak)}%`;
        td.append(bar);
      }
      cell(effect.first_token_kl === null || effect.first_token_kl === undefined ? "—" : fixed(effect.first_token_kl), "num");
      const distinct = effect.distinct_2;
      const tdDistinct = cell(distinct === null || distinct === undefined ? "—" : distinct.toFixed(2), `num${distinct !== null && distinct !== undefined && distinct < 0.5 ? " low" : ""}`);
      if (distinct !== null && distinct !== undefined && distinct < 0.5) tdDistinct.title = "Repetitive: fewer than half the bigrams are distinct";
      cell(row.error ? `${row.error.message} (${row.error.code})` : row.output_text, "text");
      rows.append(tr);
    }
  }

  if (sweepButton) sweepButton.addEventListener("click", sweep);

  // --- a new steering vector: POST /api/steering-vectors, then the page again with it chosen ----------

  const lines = (id) => $(id).value.split("\n").map((line) => line.trim()).filter(Boolean);

  async function createVector() {
    const error = $("vector-error"), stateLine = $("vector-state");
    error.hidden = true;
    const option = modelSelect.selectedOptions[0];
    const layers = Number(option?.dataset.layers) || 1;
    const body = {
      model_id: modelSelect.value,
      hook_name: $("vector-hook").value.trim() || `blocks.${Math.floor((layers - 1) / 2)}.hook_resid_post`,
      positive: lines("vector-positive"),
      negative: lines("vector-negative"),
      reduction: $("vector-last").checked ? "last" : "mean",
      name: $("vector-name").value.trim(),
    };
    const button = $("vector-create");
    button.disabled = true;
    stateLine.textContent = "Queued…";
    try {
      let vector = await mi.api("POST", "steering-vectors", body);
      while (["queued", "running"].includes(vector.status)) {
        stateLine.textContent = vector.status === "running" ? "Computing…" : "Queued…";
        await new Promise((resolve) => setTimeout(resolve, 500));
        vector = await mi.api("GET", `steering-vectors/${encodeURIComponent(vector.id)}`);
      }
      if (vector.status !== "completed") throw new mi.ApiError(500, { error: { code: vector.error_code || vector.status, message: vector.error_message || `The vector is ${vector.status}.` } });
      stateLine.textContent = `Done: norm ${Number(vector.norm).toFixed(3)}`;
      const query = new URLSearchParams({ model: modelSelect.value, vector: vector.id });
      location.assign(`${location.pathname}?${query}`);
    } catch (problem) {
      mi.showErrors(form, problem);
      form.querySelector(".form-error")?.remove();
      error.textContent = `${problem.message}${codeSuffix(problem)}`;
      error.hidden = false;
      stateLine.textContent = "";
      button.disabled = !canWrite;
    }
  }
  if ($("vector-create")) $("vector-create").addEventListener("click", createVector);

  // --- actions ---------------------------------------------------------------------------------------

  form.addEventListener("submit", (event) => { event.preventDefault(); generate(); });
  stopButton.addEventListener("click", () => state.controller?.abort());
  document.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
      event.preventDefault();
      generate();
    } else if (event.key === "Escape" && state.running && !document.querySelector("dialog[open]")) {
      state.controller?.abort();
    }
  });
  $("copy-output").addEventListener("click", async () => {
    try {
      await navigator.clipboard.writeText(outputText.textContent);
      mi.toast("Output copied.", "ok", 2);
    } catch (_) {
      mi.toast("The browser did not allow copying.", "error");
    }
  });
  if (/Mac|iPhone|iPad/.test(navigator.platform)) {
    for (const node of document.querySelectorAll("[data-shortcut]")) node.textContent = "⌘ ↵";
  }
  showMode();
})();
