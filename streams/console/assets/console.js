// turnstile console: local times, copyable ids, live updates, the operation buttons.
// Nothing here writes server data as HTML except the server's own escaped fragments.
(function () {
  "use strict";
  var body = document.body;
  var conversation = body.dataset.conversation || "";

  function localize(root) {
    root.querySelectorAll("time[data-ms]").forEach(function (t) {
      if (t.dataset.localized) return;
      var local = document.createElement("span");
      local.className = "local";
      local.textContent = " · " + new Date(Number(t.dataset.ms)).toLocaleString() + " local";
      t.after(local);
      t.dataset.localized = "1";
    });
  }
  localize(document);

  document.addEventListener("click", function (e) {
    var el = e.target.closest("[data-copy]");
    if (!el || e.target.closest("a")) return;
    if (navigator.clipboard) navigator.clipboard.writeText(el.dataset.copy).catch(function () {});
    el.classList.add("copied");
    setTimeout(function () { el.classList.remove("copied"); }, 800);
  });

  function api(path) { return "/conversations/" + encodeURIComponent(conversation) + path; }

  // Operations: the same POSTs as any API client.
  document.addEventListener("submit", function (e) {
    var form = e.target.closest("form.op");
    if (!form) return;
    e.preventDefault();
    var verb = (e.submitter && e.submitter.value) || form.dataset.op;
    var payload = { note: form.elements.note.value || undefined };
    if (verb !== "resume") { payload.call_id = form.dataset.call; payload.turn_id = form.dataset.turn; }
    var out = form.querySelector(".op-result");
    out.className = "op-result";
    out.textContent = "sending…";
    fetch(api("/" + verb), {
      method: "POST", credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-Turnstile-Console": "1" },
      body: JSON.stringify(payload)
    }).then(function (r) {
      return r.json().then(function (data) {
        if (r.ok) {
          out.textContent = verb + " written; new turn " + data.turn_id.slice(0, 10) + "…";
          out.dataset.turn = data.turn_id;
        } else {
          out.className = "op-result error";
          out.textContent = data.error || ("HTTP " + r.status);
        }
      });
    }).catch(function (err) { out.className = "op-result error"; out.textContent = String(err); });
  });

  if (!body.dataset.live || !conversation) return;

  // Live: each event the worker folds re-renders the page's main part (at most every 150 ms).
  var main = document.querySelector("main");
  var pending = null;
  function refresh() {
    if (pending) return;
    pending = setTimeout(function () {
      pending = null;
      fetch(location.pathname + "?fragment=1", { credentials: "same-origin" })
        .then(function (r) { return r.ok ? r.text() : null; })
        .then(function (html) {
          if (html === null) return;
          var kept = main.querySelector(".op-result");
          main.innerHTML = html;
          var slot = main.querySelector(".op-result");
          if (kept && slot && kept.textContent) { slot.replaceWith(kept); }
          localize(main);
          body.dataset.refreshed = String(Number(body.dataset.refreshed || 0) + 1);
        });
    }, 150);
  }
  var events = new EventSource("/ui/conversations/" + encodeURIComponent(conversation) + "/events");
  events.addEventListener("folded", function (e) {
    var data = JSON.parse(e.data);
    body.dataset.status = data.status;
    body.dataset.lastEvent = data.type;
    refresh();
  });
  events.addEventListener("reload", refresh);
  // Subscribed from here on (the server follows before it answers): what is folded now is told.
  // What was folded between the page's render and this (re)subscription is not: one refresh
  // on every open catches it (a turn that paused or ended in that gap showed as active).
  events.onopen = function () {
    body.dataset.following = "1";
    refresh();
  };

  // The reply as the model writes it (streamed replies only).
  var live = document.getElementById("live");
  if (!live || body.dataset.turn) return;
  var text = document.getElementById("live-text");
  var note = document.getElementById("live-note");
  var stream = new EventSource(api("/stream"));
  stream.addEventListener("delta", function (e) {
    var data = JSON.parse(e.data);
    live.hidden = false;
    note.textContent = "turn " + data.turn_id.slice(0, 10) + "…, attempt " + data.attempt;
    text.textContent += data.text;
  });
  stream.addEventListener("restart", function () { text.textContent = ""; });
  stream.addEventListener("interrupted", function (e) {
    note.textContent = "attempt interrupted: " + JSON.parse(e.data).reason;
    text.textContent = "";
  });
  stream.addEventListener("outcome", function () {
    live.hidden = true;
    text.textContent = "";
    refresh();
  });
})();
