// Features: keyboard navigation between a feature's dashboards (← / k previous, → / j next: the
// page's own #previous-feature / #next-feature links, so the keys go where the buttons go), and
// the "which features fire on my text" forms, whose wait for the model's worker is said on the button.
(function () {
  "use strict";

  const KEYS = { ArrowLeft: "previous-feature", k: "previous-feature", ArrowRight: "next-feature", j: "next-feature" };

  function typing(target) {
    return target instanceof HTMLElement
      && (target.isContentEditable || ["INPUT", "TEXTAREA", "SELECT"].includes(target.tagName));
  }

  function setUpKeys() {
    if (!document.getElementById("feature-page")) return;
    document.addEventListener("keydown", (event) => {
      if (event.defaultPrevented || event.altKey || event.ctrlKey || event.metaKey || event.shiftKey) return;
      if (typing(event.target)) return;
      const link = document.getElementById(KEYS[event.key] || "");
      if (!link) return;
      event.preventDefault();
      window.location.assign(link.href);
    });
  }

  function setUpEncodeForms() {
    document.querySelectorAll("#encode-form, #list-encode-form").forEach((form) => {
      form.addEventListener("submit", () => {
        const button = form.querySelector("button[type=submit]");
        button.disabled = true; // one encoding per click: it waits for the model's worker
        button.textContent = "Encoding…";
      });
    });
  }

  function start() {
    setUpKeys();
    setUpEncodeForms();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
