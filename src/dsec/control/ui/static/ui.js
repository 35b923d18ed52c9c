// dsec dashboard: the only page script besides the terminal's (no inline handlers: the
// CSP allows scripts from this origin's files only).
"use strict";
document.addEventListener("submit", (ev) => {
  const form = ev.target;
  const ask = form.getAttribute && form.getAttribute("data-confirm");
  if (ask && !window.confirm(ask)) ev.preventDefault();
});
