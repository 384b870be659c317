// Live updates for the Latchkey console: the page's <main> is replaced by
// the server's newer rendering of it (Server-Sent Events). Without this
// script every page still works; it only stays as it was until reloaded.
(function () {
  "use strict";
  var main = document.getElementById("main");
  var state = document.getElementById("live-state");
  if (!main || !window.EventSource) {
    return;
  }
  var path = location.pathname + location.search;
  var source = new EventSource("/live?path=" + encodeURIComponent(path));
  source.addEventListener("main", function (e) {
    // Rendered and escaped by the console, from the same code as the page.
    main.innerHTML = e.data;
    document.body.setAttribute("data-updated", String(Date.now()));
    if (state) {
      state.textContent = "on (updated " + new Date().toLocaleTimeString() + ")";
    }
  });
  source.onopen = function () {
    if (state) {
      state.textContent = "on";
    }
  };
  source.onerror = function () {
    if (state) {
      state.textContent = "reconnecting";
    }
  };
})();
