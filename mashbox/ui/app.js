// MASHBOX Chat, the page of `mashbox run --ui`. It talks to its own server only: GET health and
// v1/models, and POST v1/chat/completions streamed as server-sent events. Model text never becomes
// HTML: the Markdown renderer below builds DOM nodes and puts all text in text nodes.

const STORE = {
  settings: "mashbox.settings", chats: "mashbox.chats", current: "mashbox.current", key: "mashbox.key",
  removed: "mashbox.removed", // ids of deleted conversations, so that no other tab saves them back
};
const REMOVED_KEPT = 1000;
const SETTINGS = ["system", "temperature", "top_p", "max_tokens", "thinking"];
const SENDABLE = /^[\x21-\x7e]*$/; // what a header value may hold here: fetch throws on others, httpx too
const POLL_MS = { ready: 10000, waiting: 1000 };
const TAB = uid(); // this tab, as the writer of the answers it asks for
// An answer being written is saved this often (other tabs show it, and hold their composer); one that its tab has
// not saved for this long was left by a tab that was closed or killed mid-answer, and is stopped.
const ANSWER_MS = { saved: 2000, stale: 10000 };
const TOUCH = matchMedia("(pointer: coarse)"); // a phone's or tablet's screen, whose keyboard has no Shift+Enter
const PANELS = { settings: ["settings", "settings-toggle", "system"], sidebar: ["sidebar", "menu", "new-chat"] };

// -- small helpers ------------------------------------------------------------------------------

function uid() { // crypto.randomUUID is only in a secure context: not the page of a server on the LAN, over http
  return crypto.randomUUID?.() ?? Array.from(crypto.getRandomValues(new Uint8Array(16)),
    (byte) => byte.toString(16).padStart(2, "0")).join("");
}

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  Object.assign(node, props);
  node.append(...children);
  return node;
}

function sleep(ms, signal) {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) return reject(signal.reason);
    const stop = () => { clearTimeout(timer); reject(signal.reason); };
    const timer = setTimeout(() => { signal?.removeEventListener("abort", stop); resolve(); }, ms);
    signal?.addEventListener("abort", stop, { once: true });
  });
}

function load(key, fallback) {
  try { return JSON.parse(localStorage.getItem(key)) ?? fallback; } catch { return fallback; }
}

function keep(key, text) { // whether it was kept: the browser's store may be full, or off
  try { localStorage.setItem(key, text); return true; } catch { return false; }
}

function number(text) {
  const value = parseFloat(text);
  return Number.isFinite(value) ? value : undefined;
}

async function errorOf(response) {
  // The error an answer carries: its message (naming the field), and its code.
  try {
    const { message, param, code } = (await response.json()).error ?? {};
    if (!message) return { message: `HTTP ${response.status}` };
    const setting = SETTINGS.includes(param) ? ` (Settings: ${param})` : ""; // one the page sent
    return { message: param && !setting ? `${param}: ${message}` : message + setting, code };
  } catch {
    return { message: `HTTP ${response.status}` };
  }
}

async function errorMessage(response) {
  return (await errorOf(response)).message;
}

function dropOldest(messages) {
  // Leave the oldest question and its answer out of a request that does not fit; false when only the
  // last question is left.
  const first = messages.findIndex((m) => m.role === "user");
  const next = messages.findIndex((m, i) => i > first && m.role === "user");
  if (first < 0 || next < 0) return false;
  messages.splice(first, next - first);
  return true;
}

// -- server-sent events -------------------------------------------------------------------------

async function* events(body, signal) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  signal.addEventListener("abort", () => reader.cancel().catch(() => {}), { once: true });
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer = (buffer + value).replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const data = buffer.slice(0, end).split("\n").filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart()).join("\n");
      buffer = buffer.slice(end + 2);
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

// -- Markdown: blocks ---------------------------------------------------------------------------

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$/;
const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}> ?/;
const ITEM = /^( *)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const TABLE_RULE = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

function markdown(text) {
  const fragment = document.createDocumentFragment();
  blocks(text.split("\n"), fragment);
  return fragment;
}

function blocks(lines, parent) {
  let i = 0;
  while (i < lines.length) {
    if (!lines[i].trim()) i++;
    else i = block(lines, i, parent);
  }
}

function block(lines, i, parent) {
  const line = lines[i];
  let match;
  if ((match = line.match(FENCE))) return fence(lines, i, match, parent);
  if ((match = line.match(HEADING))) {
    parent.append(inline(match[2], el(`h${match[1].length}`)));
    return i + 1;
  }
  if (RULE.test(line)) { parent.append(el("hr")); return i + 1; }
  if (QUOTE.test(line)) return quote(lines, i, parent);
  if (ITEM.test(line)) return list(lines, i, parent);
  if (isTable(lines, i)) return table(lines, i, parent);
  return paragraph(lines, i, parent);
}

function startsBlock(lines, i) {
  const line = lines[i];
  return !line.trim() || FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line)
    || ITEM.test(line) || isTable(lines, i);
}

function paragraph(lines, i, parent) {
  const p = el("p");
  do {
    if (p.childNodes.length) p.append(el("br"));
    inline(lines[i].trim(), p);
    i++;
  } while (i < lines.length && !startsBlock(lines, i));
  parent.append(p);
  return i;
}

function fence(lines, i, match, parent) {
  const [, marker, lang] = match;
  const code = [];
  for (i++; i < lines.length && !lines[i].trim().startsWith(marker); i++) code.push(lines[i]);
  parent.append(codeBlock(code.join("\n"), lang.toLowerCase()));
  return i + 1; // past the closing fence (or the end, while it streams)
}

function codeBlock(code, lang) {
  const bar = el("div", { className: "code-bar" }, el("span", { textContent: lang || "code" }),
    el("button", { type: "button", className: "copy", textContent: "Copy" }));
  const pre = el("pre", {}, highlight(code, lang, el("code")));
  return el("div", { className: "code" }, bar, pre);
}

function quote(lines, i, parent) {
  const inner = [];
  for (; i < lines.length && QUOTE.test(lines[i]); i++) inner.push(lines[i].replace(QUOTE, ""));
  const node = el("blockquote");
  blocks(inner, node);
  parent.append(node);
  return i;
}

function list(lines, i, parent) {
  const [, indent, first] = lines[i].match(ITEM);
  const ordered = /\d/.test(first);
  const node = el(ordered ? "ol" : "ul");
  if (ordered && parseInt(first, 10) !== 1) node.start = parseInt(first, 10);
  let match;
  while (i < lines.length && (match = lines[i].match(ITEM)) && match[1].length === indent.length
         && /\d/.test(match[2]) === ordered) {
    const width = match[0].length - match[3].length;
    const body = [match[3]];
    for (i++; i < lines.length && continues(lines, i, indent.length); i++) {
      body.push(lines[i].slice(Math.min(width, lines[i].search(/\S|$/))));
    }
    const item = el("li");
    blocks(body, item);
    node.append(item);
  }
  parent.append(node);
  return i;
}

function continues(lines, i, indent) {
  // A line belongs to the list item above when it is indented deeper than the item's marker
  // (a blank line does when the next line with text is).
  let j = i;
  while (j < lines.length && !lines[j].trim()) j++;
  return j < lines.length && lines[j].search(/\S/) > indent;
}

function isTable(lines, i) {
  return lines[i].includes("|") && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1]) && lines[i + 1].includes("-");
}

function cells(line) {
  return line.trim().replace(/^\|/, "").replace(/\|$/, "").split(/(?<!\\)\|/).map((cell) => cell.trim());
}

function table(lines, i, parent) {
  const aligns = cells(lines[i + 1]).map((rule) =>
    rule.endsWith(":") ? (rule.startsWith(":") ? "center" : "right") : (rule.startsWith(":") ? "left" : ""));
  const row = (line, tag) => el("tr", {}, ...cells(line).map((text, n) => {
    const cell = inline(text, el(tag));
    if (aligns[n]) cell.style.textAlign = aligns[n];
    return cell;
  }));
  const head = el("thead", {}, row(lines[i], "th"));
  const body = el("tbody");
  for (i += 2; i < lines.length && lines[i].includes("|") && lines[i].trim(); i++) body.append(row(lines[i], "td"));
  parent.append(el("div", { className: "table" }, el("table", {}, head, body)));
  return i;
}

// -- Markdown: inline ---------------------------------------------------------------------------

// Each kind of span as it reads where it opens (sticky patterns: at that place only). The places where one may open are
// tried left to right, each with the kinds it may open; a kind is tried only where it can close later in the text
// (Spans), so that a line of marks that never close costs one pass over it, not one pass for each mark.
const MARK = /[`*_~[\\]|https?:\/\//g;
// An emphasis: its mark, its pattern, where it may close (the place of its last character), its tag, and what may
// not come just before it, looked at after the span before only (an escaped underscore is no word: \__a_ is _ and a
// in italics).
const EMPHASIS = [
  ["**", /\*\*(?=\S)([\s\S]*?\S)\*\*/y, /\S(?=\*\*)/g, "strong"],
  ["__", /__(?=\S)([\s\S]*?\S)__(?!\w)/y, /\S(?=__(?!\w))/g, "strong"],
  ["~~", /~~(?=\S)([\s\S]*?\S)~~/y, /\S(?=~~)/g, "del"],
  ["*", /\*(?=[^\s*])([\s\S]*?[^\s*])\*/y, /[^\s*](?=\*)/g, "em"],
  ["_", /_(?=[^\s_])([\s\S]*?[^\s_])_(?!\w)/y, /[^\s_](?=_(?!\w))/g, "em", /\w/],
];
const CODE = /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/y;
const TICKS = /`+/y;
const RUNS = /(?<!`)`+/g; // each run of backticks whole: a code span closes with one as long as it opened with
const LINK = /\[([^\]\n]+)\]\(\s*<?((?:[^\s()<>]|\([^\s()<>]*\))+)>?(?:\s+"[^"]*")?\s*\)/y;
const LABEL = /\[[^\]\n]*/y; // how far a link's label reaches
const ADDRESS = /https?:\/\/(?:[^\s<>"'`()]|\([^\s<>"'`()]*\))*(?:[^\s<>"'`.,;:!?()\]]|\([^\s<>"'`()]*\))/y;
const ESCAPE = /\\([!-/:-@[-`{-~])/y;

function inline(text, parent) {
  const spans = new Spans(text);
  let done = 0;
  for (const { index } of text.matchAll(MARK)) {
    const span = index >= done && spans.at(index, done);
    if (!span) continue;
    parent.append(text.slice(done, index), span.node);
    done = index + span.length;
  }
  parent.append(text.slice(done));
  return parent;
}

class Spans { // the spans of one text, asked for left to right; where they may close, found once when first asked
  constructor(text) {
    this.text = text;
    this.closes = new Map(); // an emphasis's closing pattern → the last place where one may close
    this.runs = null; // the length of a run of backticks → where the last one of that length starts
    this.ticks = 0; // where the run of backticks last met ends
    this.label = 0; // where the label of the last link tried ends: no link opens before it
  }

  at(i, start) { // the span that opens at i (the span before ends at start), as its node and length, or null
    const text = this.text;
    if (text[i] === "`") return this.code(i);
    if (text[i] === "[") return this.link(i);
    if (text[i] === "\\") return spanAt(ESCAPE, text, i, (m) => m[1]);
    if (text[i] === "h") return spanAt(ADDRESS, text, i, (m) => link(m[0], el("a", { textContent: m[0] }), m[0]));
    for (const [mark, pattern, close, tag, before] of EMPHASIS) {
      const span = text.startsWith(mark, i) && this.last(close) >= i + mark.length
        && !(i > start && before?.test(text[i - 1]))
        && spanAt(pattern, text, i, (m) => inline(m[1], el(tag)));
      if (span) return span;
    }
    return null;
  }

  last(close) {
    if (!this.closes.has(close)) this.closes.set(close, lastAt(this.text, close));
    return this.closes.get(close);
  }

  code(i) {
    if (i >= this.ticks) {
      TICKS.lastIndex = i;
      this.ticks = i + TICKS.exec(this.text)[0].length;
    }
    this.runs ??= runs(this.text);
    if (!(this.runs.get(this.ticks - i) > this.ticks)) return null;
    return spanAt(CODE, this.text, i, (m) => el("code", { textContent: m[2] }));
  }

  link(i) {
    if (i < this.label) return null; // within the label of one that was not a link: nor is this
    LABEL.lastIndex = i;
    this.label = i + LABEL.exec(this.text)[0].length;
    return spanAt(LINK, this.text, i, (m) => link(m[2], inline(m[1], el("a")), m[0]));
  }
}

function lastAt(text, pattern) {
  let at = -1;
  for (const m of text.matchAll(pattern)) at = m.index;
  return at;
}

function runs(text) {
  const starts = new Map();
  for (const m of text.matchAll(RUNS)) starts.set(m[0].length, m.index);
  return starts;
}

function spanAt(pattern, text, i, node) {
  pattern.lastIndex = i;
  const m = pattern.exec(text);
  return m && { node: node(m), length: m[0].length };
}

function link(address, anchor, source) {
  let url;
  try { url = new URL(address); } catch { return source; }
  if (url.protocol !== "http:" && url.protocol !== "https:") return source;
  Object.assign(anchor, { href: url.href, target: "_blank", rel: "noopener noreferrer" });
  return anchor;
}

// -- code highlighting --------------------------------------------------------------------------

const KEYWORDS = new Set(`and as async await break case catch class const continue def del elif else enum
  except export extends false final finally fn for from func function go if impl import in interface is
  lambda let loop match mod mut new nil none not null or package pass pub raise return self static struct
  super switch this throw true try type typeof use var void where while with yield`.split(/\s+/));
const HASH_COMMENTS = new Set(["python", "py", "sh", "bash", "shell", "zsh", "ruby", "rb", "yaml", "yml",
  "toml", "r", "perl", "make", "makefile", "dockerfile", "ini", "conf"]);
const DASH_COMMENTS = new Set(["sql", "lua", "haskell", "hs"]);
const STRINGS = [String.raw`"""[\s\S]*?"""|'''[\s\S]*?'''`, String.raw`"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'`,
  String.raw`\x60(?:\\.|[^\x60\\])*\x60`].join("|");
const NUMBERS = String.raw`\b(?:0x[\da-fA-F]+|\d[\d_]*(?:\.\d+)?(?:[eE][+-]?\d+)?)\b`;

function tokenizer(lang) {
  const comment = HASH_COMMENTS.has(lang) ? "#.*"
    : DASH_COMMENTS.has(lang) ? "--.*" : String.raw`\/\/.*|\/\*[\s\S]*?\*\/`;
  return new RegExp(`(${comment})|(${STRINGS})|(${NUMBERS})|([A-Za-z_$][\\w$]*)(?=\\s*(\\()?)`, "g");
}

function highlight(code, lang, parent) {
  let last = 0;
  for (const m of code.matchAll(tokenizer(lang))) {
    const kind = m[1] ? "c" : m[2] ? "s" : m[3] ? "n" : KEYWORDS.has(m[4].toLowerCase()) ? "k" : m[5] ? "f" : null;
    if (!kind) continue;
    parent.append(code.slice(last, m.index), el("span", { className: `tk-${kind}`, textContent: m[0] }));
    last = m.index + m[0].length;
  }
  parent.append(code.slice(last));
  return parent;
}

// -- one message on the page --------------------------------------------------------------------

function facts(m) {
  const t = m.timings;
  const u = m.usage;
  const parts = [];
  const tokens = u?.completion_tokens ?? t?.predicted_n;
  if (tokens !== undefined) parts.push(`${tokens} tokens`);
  if (t?.predicted_per_second) parts.push(`${t.predicted_per_second.toFixed(1)} tok/s`);
  if (u) {
    const cached = u.prompt_tokens_details?.cached_tokens;
    parts.push(`prompt ${u.prompt_tokens}${cached ? ` (${cached} cached)` : ""}`);
  }
  if (t) parts.push(`first token in ${((t.queue_ms + t.prompt_ms) / 1000).toFixed(2)} s`);
  return parts.join(" · ");
}

function note(m) {
  if (m.error) return m.error;
  if (m.pending && m.tab !== TAB) return "Being written in another tab…";
  const forked = m.forked ? "Another tab wrote in this conversation while this answer was written: this answer " +
    "went on in this copy of the conversation. " : "";
  const dropped = m.dropped ? `The conversation outgrew the context: its ${m.dropped} oldest turn${
    m.dropped > 1 ? "s were" : " was"} left out of this answer's request. ` : "";
  if (m.stopped) return `${forked}${dropped}Stopped.`;
  if (m.finish === "length") return forked + dropped + cut(m);
  return (forked + dropped).trim();
}

function cut(m) { // what cut an answer that finished for its length: max tokens where it reached them, else the context
  const written = m.usage?.completion_tokens ?? m.timings?.predicted_n;
  if (m.limit && written >= m.limit) return `Cut by max tokens (${m.limit}).`;
  return "Cut: the answer reached the end of the context.";
}

class MessageView {
  constructor(message) {
    this.message = message;
    const you = message.role === "user";
    this.node = el("article", { className: `msg ${message.role}`, ariaLabel: you ? "You" : "Answer" });
    this.thinking = el("details", { className: "thinking", hidden: true }, el("summary", { textContent: "Thinking" }),
      el("div", { className: "thinking-text" }));
    this.content = el("div", { className: you ? "content plain" : "content md" });
    this.tools = el("div", { className: "tools", hidden: true });
    this.note = el("p", { className: "note", hidden: true });
    this.footer = el("footer", { className: "meta" }, el("span", { className: "facts" }));
    this.node.append(this.thinking, this.content, this.tools, this.note, this.footer);
    this.opened = false;
    this.frame = 0;
    this.update();
  }

  schedule() {
    this.frame ||= requestAnimationFrame(() => {
      const log = this.node.parentElement;
      const follow = log && following(log);
      this.frame = 0;
      this.update();
      // at once: a smooth scroll still under way at the next frame would read as the reader's scrolling up
      if (follow) log.scrollTo({ top: log.scrollHeight, behavior: "instant" });
    });
  }

  update() {
    const m = this.message;
    this.node.ariaBusy = m.pending ? "true" : "false";
    if (m.role === "user") this.content.textContent = m.content;
    else this.content.replaceChildren(markdown(m.content));
    this.showThinking(m);
    this.tools.hidden = !m.tools?.length;
    this.tools.replaceChildren(...(m.tools ?? []).map((call) => el("div", { className: "tool" },
      el("div", { className: "tool-name", textContent: `Tool call: ${call.name}` }),
      el("pre", { textContent: call.arguments }))));
    this.note.textContent = note(m);
    this.note.hidden = !this.note.textContent;
    this.note.classList.toggle("error", Boolean(m.error));
    this.footer.firstChild.textContent = facts(m);
  }

  showThinking(m) {
    if (!m.reasoning) return;
    const answering = Boolean(m.content || m.tools?.length || !m.pending);
    this.thinking.hidden = false;
    this.thinking.firstChild.textContent = answering ? "Thought" : "Thinking…";
    this.thinking.lastChild.textContent = m.reasoning;
    if (!this.opened && !answering) this.thinking.open = this.opened = true;
    else if (this.opened && answering && m.pending) this.thinking.open = this.opened = false;
  }

  actions(buttons) {
    this.footer.append(...buttons.map(([label, run]) =>
      el("button", { type: "button", className: "quiet", textContent: label, onclick: run })));
  }
}

// -- the page -----------------------------------------------------------------------------------

class ChatPage {
  constructor() {
    this.ui = Object.fromEntries([...document.querySelectorAll("[id]")].map((node) => [node.id, node]));
    this.chats = load(STORE.chats, []);
    this.chat = this.chats.find((chat) => chat.id === localStorage.getItem(STORE.current)) ?? this.fresh();
    this.settings = load(STORE.settings, {});
    this.state = "connecting";
    this.model = null;
    this.running = null; // the AbortController of the answer being written
    this.answering = null; // and its conversation, until it is saved whole
    this.recheck = 0; // the timer that looks again at an answer another tab writes in the conversation shown
    this.notice = ["", false]; // the server's state, as the banner says it (text, retry button)
    this.unsaved = ""; // why the last save failed, said until a save works
    this.wake = () => {};
    this.chats.forEach(settle);
  }

  start() {
    this.bind();
    this.showSettings();
    this.render();
    this.watch();
  }

  bind() {
    const ui = this.ui;
    ui.composer.addEventListener("submit", (event) => { event.preventDefault(); this.send(); });
    ui.prompt.addEventListener("keydown", (event) => enterSends(event, () => this.send()));
    ui.prompt.addEventListener("input", () => fit(ui.prompt));
    ui.stop.addEventListener("click", () => { this.running?.abort(); ui.prompt.focus(); });
    ui["new-chat"].addEventListener("click", () => this.open(this.fresh()));
    ui.export.addEventListener("click", () => this.exportChats());
    ui.menu.addEventListener("click", () => this.panel("sidebar"));
    ui["settings-toggle"].addEventListener("click", () => this.panel("settings"));
    ui["settings-close"].addEventListener("click", () => this.panel("settings", false));
    ui["banner-retry"].addEventListener("click", () => this.wake());
    ui.log.addEventListener("click", (event) => copyCode(event.target));
    ui["key-dialog"].addEventListener("cancel", (event) => event.preventDefault()); // nothing works without it
    for (const name of SETTINGS) ui[name].addEventListener("input", () => this.saveSettings());
    window.addEventListener("storage", (event) => { // another tab saved or deleted conversations
      if (event.key !== STORE.chats && event.key !== STORE.removed) return;
      const shown = this.chat;
      this.merge(load(STORE.chats, []));
      if (this.running && !this.chats.includes(this.answering)) this.running.abort(); // deleted there: it stops
      if (this.running) this.renderList();
      else if (this.chat.messages.length && !this.chats.includes(this.chat)) this.open(this.chats[0] ?? this.fresh());
      else if (this.chat !== shown) this.render(); // this conversation went on in the other tab
      else this.renderList(); // an edit under way and where the reader is stay as they are
    });
    const partial = () => { if (this.answering) this.save(this.answering); }; // what has come, should the page close
    window.addEventListener("pagehide", () => { this.running?.abort(); partial(); }); // stopped, not lost
    document.addEventListener("visibilitychange", () => { if (document.hidden) partial(); });
    document.addEventListener("keydown", (event) => {
      if (event.key === "Escape") for (const name in PANELS) this.panel(name, false);
    });
    ui.main.addEventListener("click", (event) => { // a tap beside the sliding conversation list closes it
      if (ui.sidebar.classList.contains("open") && !ui.menu.contains(event.target)) this.panel("sidebar", false);
    });
  }

  panel(name, open = undefined) {
    const [panel, button, first] = PANELS[name].map((id) => this.ui[id]);
    open ??= button.ariaExpanded !== "true";
    panel.classList.toggle("open", open);
    button.ariaExpanded = String(open);
    if (open) first.focus();
    else if (panel.contains(document.activeElement)) this.ui.prompt.focus();
  }

  // -- the server: health, model, key ----------------------------------------------------------

  async watch() {
    for (;;) {
      try {
        await this.check();
      } catch {
        this.enter("gone");
      }
      await new Promise((resolve) => {
        const timer = setTimeout(resolve, this.state === "ready" ? POLL_MS.ready : POLL_MS.waiting);
        this.wake = () => { clearTimeout(timer); resolve(); };
      });
    }
  }

  async check() {
    const response = await fetch("health", { cache: "no-store" });
    if (response.status === 503) return this.enter("loading");
    if (!this.model) await this.loadModel();
    this.enter("ready");
  }

  async loadModel() {
    const response = await this.call("v1/models", {});
    if (!response.ok) throw new Error(await errorMessage(response));
    this.model = (await response.json()).data[0];
    this.ui["model-id"].textContent = this.model.id;
  }

  enter(state) {
    this.state = state;
    this.ui["status-dot"].dataset.state = state;
    if (state === "gone") {
      this.model = null;
      this.banner("The server is not answering. Is mashbox run still running? Trying again every second…", true);
    } else if (state === "loading") {
      this.banner("The model is loading. The chat opens when it is ready…");
    } else {
      this.banner("");
      const m = this.model;
      this.ui["model-facts"].textContent = m ? `ctx ${m.max_model_len} · ${m.slots} slots` : "";
    }
  }

  banner(text, retry = false) {
    this.notice = [text, retry];
    const shown = [text, this.unsaved].filter(Boolean).join(" ");
    this.ui.banner.hidden = !shown;
    this.ui["banner-text"].textContent = shown;
    this.ui["banner-retry"].hidden = !retry;
  }

  // A request that waits out what can be waited out: a missing key (asked for once), a model
  // still loading (503), a full queue (429). Any other answer is returned; a server that does
  // not answer is thrown.
  async call(path, init, signal) {
    for (;;) {
      const key = sessionStorage.getItem(STORE.key);
      if (!SENDABLE.test(key ?? "")) {
        await this.askKey("the key holds characters other than printable ASCII, which cannot be sent");
        continue;
      }
      const headers = { ...init.headers, ...(key ? { authorization: `Bearer ${key}` } : {}) };
      let response;
      try {
        response = await fetch(path, { ...init, headers, signal });
      } catch (err) {
        if (!signal?.aborted) { this.enter("gone"); this.wake(); }
        throw err;
      }
      const wait = Number(response.headers.get("retry-after")) || 1;
      if (response.status === 401) await this.askKey(await errorMessage(response));
      else if (response.status === 503) await this.untilReady(signal);
      else if (response.status === 429) await this.later(wait, signal);
      else return response;
    }
  }

  async untilReady(signal) {
    this.enter("loading");
    this.wake();
    while (this.state !== "ready") await sleep(250, signal);
  }

  async later(seconds, signal) {
    this.banner(`The server is busy: its queue is full. Sending again in ${seconds} s…`);
    await sleep(seconds * 1000, signal);
    this.banner("");
  }

  askKey(reason) {
    const ui = this.ui;
    ui["key-reason"].textContent = sessionStorage.getItem(STORE.key) ? `The server said: ${reason}.` : "";
    ui["key-reason"].hidden = !ui["key-reason"].textContent;
    ui.key.value = "";
    if (!ui["key-dialog"].open) ui["key-dialog"].showModal();
    return new Promise((resolve) => ui["key-form"].addEventListener("submit", () => {
      sessionStorage.setItem(STORE.key, ui.key.value.trim());
      resolve();
    }, { once: true }));
  }

  // -- chatting ---------------------------------------------------------------------------------

  send() {
    const text = this.ui.prompt.value;
    if (this.running || elsewhere(this.chat) || !text.trim()) return;
    this.ui.prompt.value = "";
    fit(this.ui.prompt);
    this.chat.messages.push({ role: "user", content: text });
    this.chat.title ||= titled(text);
    this.ui.prompt.focus();
    this.answer();
  }

  async answer() {
    const chat = this.chat;
    const body = this.request(chat);
    const reply = { role: "assistant", content: "", reasoning: "", tools: [], pending: true, tab: TAB,
      limit: body.max_tokens };
    chat.messages.push(reply);
    this.running = new AbortController();
    this.answering = chat;
    const { signal } = this.running;
    // stopped at once, as a page that closes saves it (and as the conversation shown next draws it)
    signal.addEventListener("abort", () => Object.assign(reply, { pending: false, stopped: true }), { once: true });
    const saving = setInterval(() => this.save(chat), ANSWER_MS.saved);
    this.busy(true);
    this.save(chat);
    this.render(true);
    try {
      await this.stream(body, reply, this.views.at(-1), signal);
    } catch (err) {
      if (!signal.aborted) reply.error = err instanceof SyntaxError ? `A bad answer from the server: ${err.message}`
        : "The connection to the server was lost.";
    } finally {
      clearInterval(saving);
      reply.pending = false;
      this.running = null;
      this.busy(false);
      this.save(chat);
      this.answering = null;
      const deleted = !this.chats.includes(chat); // by another tab, while the answer was written
      if (chat === this.chat && deleted) this.open(this.chats[0] ?? this.fresh());
      else if (chat === this.chat) this.render();
      this.wake();
    }
  }

  async stream(body, reply, view, signal) {
    let response;
    for (;;) { // a conversation that outgrew the context goes on without its oldest turns, as `mashbox chat`'s
      const init = { method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(body) };
      response = await this.call("v1/chat/completions", init, signal);
      if (response.ok) break;
      const error = await errorOf(response);
      if (error.code !== "context_length_exceeded" || !dropOldest(body.messages)) {
        reply.error = error.message;
        return;
      }
      reply.dropped = (reply.dropped ?? 0) + 1;
    }
    for await (const chunk of events(response.body, signal)) {
      if (chunk.error) reply.error = chunk.error.message;
      const choice = chunk.choices?.[0];
      const delta = choice?.delta ?? {};
      reply.reasoning += delta.reasoning_content ?? delta.reasoning ?? "";
      reply.content += delta.content ?? "";
      for (const call of delta.tool_calls ?? []) addToolCall(reply.tools, call);
      reply.finish = choice?.finish_reason ?? reply.finish;
      reply.usage = chunk.usage ?? reply.usage;
      reply.timings = chunk.timings ?? reply.timings;
      view.schedule();
    }
    if (!reply.finish && !reply.error && !signal.aborted) reply.error = "The answer was cut off: its stream ended early.";
  }

  request(chat) {
    const s = this.settings;
    const messages = chat.messages; // a question that got no answer (refused, failed, stopped at once) is left out
    const answered = (m, i) => m.role !== "user" || i === messages.length - 1 || messages[i + 1].content;
    const turns = messages.filter((m, i) => m.content && answered(m, i))
      .map((m) => ({ role: m.role, content: m.content }));
    const body = {
      messages: s.system?.trim() ? [{ role: "system", content: s.system }, ...turns] : turns,
      stream: true,
      stream_options: { include_usage: true },
      temperature: number(s.temperature),
      top_p: number(s.top_p),
      max_tokens: number(s.max_tokens),
    };
    if (this.model) body.model = this.model.id;
    if (chat.id) body.prompt_cache_key = chat.id; // its session: kept warm, and on one replica behind a balancer
    if (s.thinking) body.chat_template_kwargs = { enable_thinking: s.thinking === "on" };
    return body;
  }

  busy(running) {
    this.ui.send.hidden = running;
    this.ui.stop.hidden = !running;
    if (!running && !this.ui.settings.contains(document.activeElement)) this.ui.prompt.focus();
  }

  regenerate() {
    if (this.running) return; // the answer of a conversation left a moment ago, still ending
    this.chat.messages.pop();
    this.answer();
  }

  edit(view) {
    const m = view.message;
    const box = el("textarea", { className: "edit", value: m.content, ariaLabel: "Edit your message" });
    const resend = () => {
      if (this.running || !box.value.trim()) return;
      const messages = this.chat.messages;
      messages.splice(messages.indexOf(m));
      if (!messages.length) this.chat.title = titled(box.value);
      messages.push({ role: "user", content: box.value });
      this.answer();
    };
    box.addEventListener("keydown", (event) => {
      if (event.key === "Escape") { event.stopPropagation(); this.render(); }
      enterSends(event, resend);
    });
    view.content.replaceChildren(box);
    view.footer.replaceChildren();
    view.actions([["Send again", resend], ["Cancel", () => this.render()]]);
    fit(box);
    box.focus();
  }

  // -- conversations --------------------------------------------------------------------------

  fresh() {
    return { id: uid(), title: "", created: new Date().toISOString(), messages: [] };
  }

  open(chat) {
    if (chat !== this.chat) this.running?.abort();
    this.chat = chat;
    keep(STORE.current, chat.id);
    this.panel("sidebar", false);
    this.render(true);
    this.ui.prompt.focus();
  }

  remove(chat) {
    keep(STORE.removed, JSON.stringify([...load(STORE.removed, []), chat.id].slice(-REMOVED_KEPT)));
    this.chats = this.chats.filter((other) => other !== chat);
    if (chat === this.chat) this.open(this.chats[0] ?? this.fresh());
    this.save();
    this.renderList();
  }

  save(chat = null) { // chat: the one an answer is written in here, if it changed
    if (chat?.messages.length && !this.chats.includes(chat)) this.chats.unshift(chat);
    this.merge(load(STORE.chats, []));
    if (chat) chat.updated = Date.now();
    keep(STORE.current, this.chat.id);
    const saved = keep(STORE.chats, JSON.stringify(this.chats));
    this.unsaved = saved ? "" : "Conversations cannot be saved in this browser: its storage is full (or off). " +
      "Delete old ones to make room, after Export all if you want to keep them.";
    this.banner(...this.notice);
  }

  merge(stored) {
    // Tabs share one list: each conversation as it was saved last, by whichever tab; none that a tab deleted. The one
    // this tab writes an answer in stays as it is here: should another tab save it meanwhile (one that took the
    // answer for one left by a closed tab, or sent at the same moment), this tab's goes on as a copy: both are kept.
    const removed = new Set(load(STORE.removed, []));
    const chats = new Map(stored.map((chat) => [chat.id, chat]));
    for (const chat of this.chats) {
      const saved = chats.get(chat.id);
      if (chat === this.answering && saved?.updated > chat.updated) fork(chat);
      if (chat === this.answering || (chat.updated ?? 0) >= (saved?.updated ?? 0)) chats.set(chat.id, chat);
    }
    for (const id of removed) chats.delete(id);
    this.chats = [...chats.values()].sort((a, b) => b.created.localeCompare(a.created));
    this.chats.forEach(settle);
    this.chat = chats.get(this.chat.id) ?? this.chat;
  }

  exportChats() {
    const blob = new Blob([JSON.stringify(this.chats, null, 2)], { type: "application/json" });
    const anchor = el("a", { href: URL.createObjectURL(blob), download: "mashbox-chats.json" });
    anchor.click();
    setTimeout(() => URL.revokeObjectURL(anchor.href), 1000);
  }

  showSettings() {
    for (const name of SETTINGS) this.ui[name].value = this.settings[name] ?? "";
  }

  saveSettings() {
    this.settings = Object.fromEntries(SETTINGS.map((name) => [name, this.ui[name].value]));
    keep(STORE.settings, JSON.stringify(this.settings));
  }

  // -- drawing ----------------------------------------------------------------------------------

  render(bottom = false) { // bottom: show the end (else where the reader is stays, unless they follow the end)
    const log = this.ui.log;
    const place = bottom || following(log) ? null : log.scrollTop;
    const messages = this.chat.messages;
    this.views = messages.map((m) => new MessageView(m));
    const last = this.views.at(-1);
    const lastUser = this.views.findLast((view) => view.message.role === "user");
    const done = !messages.some((m) => m.pending); // no answer being written in it, here or in another tab
    if (done && last?.message.role === "assistant") {
      last.actions([["Regenerate", () => this.regenerate()],
        ["Copy", (event) => copy(last.message.content, event.target)]]);
    }
    if (done && lastUser) lastUser.actions([["Edit", () => this.edit(lastUser)]]);
    this.ui.empty.hidden = messages.length > 0;
    log.replaceChildren(this.ui.empty, ...this.views.map((view) => view.node));
    log.scrollTo({ top: place ?? log.scrollHeight, behavior: "instant" });
    this.hold();
    this.renderList();
  }

  hold() {
    // While another tab writes an answer in the conversation shown, nothing is sent into it here; a look again later
    // finds it ended (saved by that tab, and drawn by the storage event), or stopped (a tab closed mid-answer).
    const held = elsewhere(this.chat);
    this.ui.held.hidden = !held;
    this.ui.hint.hidden = held;
    this.ui.send.disabled = held;
    clearTimeout(this.recheck);
    if (held) this.recheck = setTimeout(() => { this.merge(load(STORE.chats, [])); this.render(); }, ANSWER_MS.stale);
  }

  renderList() {
    this.ui.chats.replaceChildren(...this.chats.map((chat) => {
      const title = chat.title || "New chat";
      const link = el("button", { type: "button", className: "chat-link", textContent: title, title,
        onclick: () => this.open(chat) });
      if (chat === this.chat) link.ariaCurrent = "page";
      const drop = el("button", { type: "button", className: "icon drop", textContent: "✕",
        ariaLabel: `Delete “${title}”`, onclick: () => this.remove(chat) });
      return el("li", {}, link, drop);
    }));
  }
}

function elsewhere(chat) { // whether another tab is writing an answer in this conversation
  return chat.messages.some((m) => m.pending && m.tab !== TAB);
}

function settle(chat) { // an answer that its tab stopped saving (closed or killed mid-answer) is stopped
  if (Date.now() - (chat.updated ?? 0) < ANSWER_MS.stale) return;
  for (const m of chat.messages) {
    if (m.pending && m.tab !== TAB) Object.assign(m, { pending: false, stopped: true });
  }
}

function fork(chat) { // this tab's copy of a conversation that another tab saved while an answer was written here
  Object.assign(chat, { id: uid(), title: `${chat.title} (copy)` });
  chat.messages.at(-1).forked = true;
}

function following(log) { // whether the reader is at the end of the conversation (and so follows an answer)
  return log.scrollHeight - log.scrollTop - log.clientHeight < 80;
}

function addToolCall(calls, delta) {
  const call = (calls[delta.index ?? calls.length] ??= { name: "", arguments: "" });
  call.name += delta.function?.name ?? "";
  call.arguments += delta.function?.arguments ?? "";
}

function titled(text) { // a chat's title: its first words, cut between characters (not inside an emoji's pair)
  return [...text.trim()].slice(0, 60).join("");
}

function enterSends(event, send) { // on a touch screen (no Shift) Enter starts a new line: the button sends
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing && !TOUCH.matches) {
    event.preventDefault();
    send();
  }
}

function fit(box) {
  box.style.height = "auto";
  box.style.height = `${Math.min(box.scrollHeight, 240)}px`;
}

function copyCode(target) {
  if (target.classList.contains("copy")) copy(target.closest(".code").querySelector("code").textContent, target);
}

async function copy(text, button) {
  const label = button.textContent;
  try {
    await navigator.clipboard.writeText(text);
    button.textContent = "Copied";
  } catch {
    button.textContent = "Copy failed";
  }
  setTimeout(() => { button.textContent = label; }, 1500);
}

new ChatPage().start();
