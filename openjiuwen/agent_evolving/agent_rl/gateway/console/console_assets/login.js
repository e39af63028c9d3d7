// Exchanges the login token of the URL fragment (never sent to any server, so never in an access log) for the
// console's session cookie, then opens the console. The fragment is removed from the address bar and history first.
"use strict";
(function () {
  const state = document.getElementById("login-state");
  const params = new URLSearchParams(window.location.hash.slice(1));
  const token = params.get("token");
  window.history.replaceState(null, "", window.location.pathname);
  if (!token) {
    state.textContent = "Not logged in. Open a login link to start a session.";
    return;
  }
  fetch("/console/login", {
    method: "POST",
    credentials: "same-origin",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ token: token }),
  }).then(function (resp) {
    if (resp.status === 204) {
      window.location.replace("/console/");
      return;
    }
    state.textContent = "This login link is invalid, expired or already used. Print a new one.";
    state.className = "bad";
  }, function () {
    state.textContent = "The gateway did not answer. Try again.";
    state.className = "bad";
  });
})();
