// dsec dashboard terminal: xterm.js (vendored, MIT) over the dashboard's WebSocket, which
// carries proc's framing (docs/api.md): binary frames are terminal bytes both ways, text
// frames JSON control ({"resize": [cols, rows]} out; {"exit_code": N} in, the last one).
// The session cookie authenticates the handshake; no key is ever visible to this script.
"use strict";
(function () {
  const el = document.getElementById("term");
  const status = document.getElementById("term-status");
  if (!el || !window.Terminal) { if (status) status.textContent = "terminal unavailable"; return; }
  // Output is the sandbox's, so hostile: it is terminal data, never HTML; a hyperlink it
  // prints (OSC 8) opens only if it is http(s), in a new tab without an opener.
  const term = new window.Terminal({
    cols: 100, rows: 30, convertEol: false, cursorBlink: true,
    linkHandler: {
      activate: (ev, uri) => {
        if (/^https?:\/\//i.test(uri)) window.open(uri, "_blank", "noopener,noreferrer");
      },
    },
  });
  term.open(el);
  const proto = location.protocol === "https:" ? "wss:" : "ws:";
  const ws = new WebSocket(proto + "//" + location.host + el.getAttribute("data-ws"));
  ws.binaryType = "arraybuffer";
  const enc = new TextEncoder();
  ws.onopen = () => {
    status.textContent = "connected";
    ws.send(JSON.stringify({ resize: [term.cols, term.rows] }));
    term.focus();
  };
  ws.onmessage = (ev) => {
    if (typeof ev.data === "string") {
      let msg = {};
      try { msg = JSON.parse(ev.data); } catch (e) { return; }
      if ("exit_code" in msg) status.textContent = "exited with code " + msg.exit_code;
      else if (msg.error) status.textContent = "error: " + (msg.error.message || msg.error.code);
      return;
    }
    term.write(new Uint8Array(ev.data));
  };
  ws.onclose = (ev) => {
    if (status.textContent === "connected" || status.textContent.startsWith("connecting"))
      status.textContent = "closed" + (ev.reason ? ": " + ev.reason : "");
  };
  term.onData((d) => { if (ws.readyState === 1) ws.send(enc.encode(d)); });
  term.onResize((s) => { if (ws.readyState === 1) ws.send(JSON.stringify({ resize: [s.cols, s.rows] })); });
  window.dsecTerminal = term;   // read by the browser tests
})();
