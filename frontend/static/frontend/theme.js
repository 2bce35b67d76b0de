// Runs before the first paint (a blocking script in <head>): the saved theme, so a dark page never
// flashes white. A file rather than an inline script: the Content-Security-Policy allows no inline code.
(function () {
  var theme = localStorage.getItem("mistudio-theme");
  if (theme === "light" || theme === "dark") document.documentElement.dataset.theme = theme;
})();
