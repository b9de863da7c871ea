// The web terminal page: xterm.js attached to envd's /terminal WebSocket via the proxy.
// Protocol (envd/services/process/terminal.py): binary frames carry bytes both ways; text
// frames up are JSON control messages ({"type":"resize",cols,rows}); the server's text
// frame {"type":"exit",exitCode} ends a session. When the socket closes (sandbox paused,
// network), the page asks /status and reconnects once the sandbox is running again.
import { Terminal } from "./vendor/xterm.mjs";
import { FitAddon } from "./vendor/addon-fit.mjs";

const base = location.pathname.replace(/\/+$/, "");
const statusEl = document.getElementById("status");
const term = new Terminal({ cursorBlink: true, fontFamily: "monospace", fontSize: 14,
                            scrollback: 5000 });
const fit = new FitAddon();
term.loadAddon(fit);
term.open(document.getElementById("terminal"));
fit.fit();

const encoder = new TextEncoder();
let ws = null;
let sessions = 0;
let waitMs = 250;

function show(state, text) {
  document.body.dataset.state = state;
  statusEl.textContent = text;
}

function send(data) {
  if (ws && ws.readyState === WebSocket.OPEN) ws.send(data);
}

function connect() {
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  const url = `${scheme}//${location.host}${base}/ws?cols=${term.cols}&rows=${term.rows}`;
  const sock = new WebSocket(url);
  sock.binaryType = "arraybuffer";
  ws = sock;
  show("connecting", "connecting…");
  sock.onopen = () => {
    sessions += 1;
    waitMs = 250;
    show("connected", sessions > 1 ? `connected (session ${sessions})` : "connected");
    term.focus();
  };
  sock.onmessage = (ev) => {
    if (typeof ev.data !== "string") {
      term.write(new Uint8Array(ev.data));
      return;
    }
    const msg = JSON.parse(ev.data);
    if (msg.type === "exit") {
      term.write(`\r\n[process exited with code ${msg.exitCode}]\r\n`);
    }
  };
  sock.onclose = (ev) => {
    if (ws !== sock) return;
    ws = null;
    if (ev.code === 4401) {
      show("expired", "link expired: print a new one with `aenv terminal --web`");
      return;
    }
    show("disconnected", `disconnected (${ev.code}${ev.reason ? ": " + ev.reason : ""})`);
    setTimeout(waitForSandbox, waitMs);
  };
}

// Reconnect only to a running sandbox: the proxy does not resume one for this page.
async function waitForSandbox() {
  let answer;
  try {
    answer = await fetch(`${base}/status`, { cache: "no-store" });
  } catch (err) {
    return retry("host unreachable");
  }
  if (answer.status === 401) {
    show("expired", "link expired: print a new one with `aenv terminal --web`");
    return;
  }
  if (answer.status === 404 || answer.status === 410) {
    show("gone", "the sandbox no longer exists");
    return;
  }
  const { state } = await answer.json();
  if (state === "killed" || state === "killing") {
    show("gone", "the sandbox no longer exists");
  } else if (state === "running") {
    connect();
  } else {
    retry(`sandbox ${state}: waiting for it to run`);
  }
}

function retry(text) {
  show("waiting", text);
  waitMs = Math.min(waitMs * 2, 3000);
  setTimeout(waitForSandbox, waitMs);
}

term.onData((data) => send(encoder.encode(data)));
term.onResize(({ cols, rows }) => send(JSON.stringify({ type: "resize", cols, rows })));
new ResizeObserver(() => fit.fit()).observe(document.getElementById("terminal"));

// For tests and debugging: the visible screen as text, one string per row.
window.aenvTerminal = {
  term,
  screen() {
    const buf = term.buffer.active;
    const rows = [];
    for (let y = 0; y < term.rows; y++) {
      const line = buf.getLine(buf.viewportY + y);
      rows.push(line ? line.translateToString(true) : "");
    }
    return rows;
  },
};

connect();
