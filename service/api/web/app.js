// nmt-serve's page: translate through the HTTP/JSON API (server-sent events for the partial
// results) and draw the chosen hypothesis' attention as an SVG heatmap. Plain JS, no build step.
"use strict";

// Mirrors service/text/placeholders.py (_PATTERN; tests/test_web.py checks them against each other):
// the server puts ｟k｠ in place of the k-th placeholder of the text; the page shows it back as written.
const W = "[\\p{L}\\p{N}_]", D = "\\p{Nd}";
const PLACEHOLDER = new RegExp([
  "%%",
  `%\\([A-Za-z_](?:${W}|\\.)*\\)[-+#0]*${D}*(?:\\.${D}+)?[diouxXeEfFgGcrsa]`,
  `%(?:${D}+\\$)?[-+#0]*(?:${D}+|\\*)?(?:\\.(?:${D}+|\\*))?(?:hh|h|ll|l|L|q|j|z|Z|t|I64|I32|I)?[diouxXeEfFgGcrsSpaAnm]`,
  "\\{\\{|\\}\\}",
  `\\{[A-Za-z_0-9](?:${W}|[.\\[\\]])*(?:![rsa])?(?::[^{}]*)?\\}`,
  `\\$\\{[A-Za-z_]${W}*\\}|\\$[A-Za-z_]${W}*`,
  `</?[A-Za-z](?:${W}|[:.\\-])*(?:\\s+[^<>]*?)?/?>`,
].join("|"), "gu");
const MAX_PLACEHOLDERS = 16;
const RESERVED = /\uff5f(\d+)\uff60/g;
const SVG = "http://www.w3.org/2000/svg";

function findPlaceholders(text) {
  return Array.from(text.matchAll(PLACEHOLDER), (m) => m[0]).slice(0, MAX_PLACEHOLDERS);
}

// A piece as the user would read it: SentencePiece's word mark dropped, placeholders restored.
function showPiece(piece, placeholders) {
  const shown = piece.replace(/\u2581/g, " ").trim()
    .replace(RESERVED, (token, k) => (k < placeholders.length ? placeholders[k] : token));
  return shown || "\u2581";
}

const $ = (id) => document.getElementById(id);

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

// The access token (--auth-token-file): in this tab's sessionStorage only (never localStorage nor
// a cookie: it goes when the tab closes), sent as "Authorization: Bearer <token>" on the API calls.
const TOKEN_KEY = "nmt.token";
const NEEDS_TOKEN = "This server needs an access token: enter it under Access token above and press Use token.";

function withToken(headers = {}) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  return token ? { ...headers, Authorization: `Bearer ${token}` } : headers;
}

// A refused API call as an Error: a 401 asks for the token, anything else says the server's error.
async function refusal(reply) {
  if (reply.status === 401) return new Error(NEEDS_TOKEN);
  const body = await reply.json();
  return new Error(`${body.code}: ${body.message}`);
}

function useToken(event) {
  event.preventDefault();
  const token = $("token").value.trim();
  if (token) sessionStorage.setItem(TOKEN_KEY, token);
  else sessionStorage.removeItem(TOKEN_KEY);
  showError("");
  $("status").textContent = token ? "access token set for this tab" : "access token cleared";
  loadModels().catch((e) => showError(`models: ${e.message}`));
}

// English names of the language codes (mirrors service/languages.py NAMES; tests check them).
const NAMES = { en: "English", fr: "French", de: "German", es: "Spanish", it: "Italian", pt: "Portuguese",
                nl: "Dutch", pl: "Polish", ru: "Russian", ja: "Japanese", zh: "Chinese", ko: "Korean",
                ar: "Arabic", sv: "Swedish", cs: "Czech" };
const languageName = (code) => (NAMES[code] ? `${NAMES[code]} (${code})` : code);

// The served directions, [source, target] per model in the server's order (the default first),
// and each model option's direction; a request names the languages, the server picks the model.
const directions = [];
const modelDirections = new Map();

function fillSelect(select, codes, wanted) {
  select.replaceChildren(...codes.map((code) => new Option(languageName(code), code)));
  if (codes.includes(wanted)) select.value = wanted;
}

const served = (source, target) => directions.some(([s, t]) => s === source && t === target);

// Sources, the chosen source's targets, and the swap button only where the reverse pair is served.
function showLanguages(source, target) {
  fillSelect($("source"), [...new Set(directions.map(([s]) => s))], source);
  const targets = directions.filter(([s]) => s === $("source").value).map(([, t]) => t);
  fillSelect($("target"), [...new Set(targets)], target);
  $("swap").disabled = !served($("target").value, $("source").value);
}

// A language picked: the model is the server's choice again.
function pickLanguages(source, target) {
  showLanguages(source, target);
  $("model").value = "";
}

// A model picked by name: the selectors show its direction.
function pickModel() {
  const direction = modelDirections.get($("model").value);
  if (direction) showLanguages(...direction);
}

async function loadModels() {
  $("model").replaceChildren();
  directions.length = 0;
  modelDirections.clear();
  const reply = await fetch("/v1/models", { headers: withToken() });
  if (!reply.ok) throw await refusal(reply);
  const body = await reply.json();
  for (const m of body.models) {
    const ref = `${m.name}/${m.version}`;
    const option = new Option(`${ref} (${m.precision}, ${m.provider})`, ref);
    option.selected = m.is_default;
    $("model").append(option);
    if (m.source_language && m.target_language) {
      directions.push([m.source_language, m.target_language]);
      modelDirections.set(option.value, [m.source_language, m.target_language]);
    }
  }
  if (!directions.length) return;  // models that name no languages: pick by name only
  $("model").prepend(new Option("by the languages", ""));
  $("languages").hidden = false;
  pickLanguages(...directions[0]);
}

function request(text) {
  const beam = Number($("beam").value), nbest = Math.min(Number($("nbest").value), beam);
  const body = { texts: [text], model: $("model").value,
                 options: { beam_size: beam, num_hypotheses: nbest, return_scores: true, return_attention: true } };
  if (!body.model && directions.length) {
    Object.assign(body, { source_language: $("source").value, target_language: $("target").value });
  }
  return body;
}

// POST with server-sent events back (EventSource can only GET): calls onEvent(name, data).
async function postEvents(url, body, onEvent) {
  const reply = await fetch(url, { method: "POST", headers: withToken({ "Content-Type": "application/json" }),
                                   body: JSON.stringify(body) });
  if (!reply.ok) throw await refusal(reply);
  const reader = reply.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const fields = Object.fromEntries(block.split("\n").map((line) => {
        const at = line.indexOf(": ");
        return [line.slice(0, at), line.slice(at + 2)];
      }));
      onEvent(fields.event, JSON.parse(fields.data));
    }
  }
}

function svg(name, attributes, text) {
  const node = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attributes)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

// Source pieces across, target pieces down, darker = more attention (the paper's figures).
function drawHeatmap(translation, hypothesis, placeholders) {
  const source = translation.source_tokens.map((p) => showPiece(p, placeholders));
  const rows = hypothesis.alignments;
  const columns = rows.length ? rows[0].weights.length : source.length;
  while (source.length < columns) source.push("</s>");
  const target = hypothesis.tokens.map((p) => showPiece(p, placeholders));
  const cell = 22, left = 12 + 8 * Math.max(4, ...target.map((t) => t.length));
  const top = 12 + 6 * Math.max(4, ...source.map((t) => t.length));
  const root = svg("svg", { width: left + cell * columns + 10, height: top + cell * rows.length + 10,
                            viewBox: `0 0 ${left + cell * columns + 10} ${top + cell * rows.length + 10}`,
                            role: "img", "aria-label": "attention heatmap" });
  source.forEach((piece, j) => {
    const x = left + cell * j + cell / 2;
    root.append(svg("text", { x, y: top - 6, transform: `rotate(-60 ${x} ${top - 6})`, class: "source" }, piece));
  });
  rows.forEach((a, i) => {
    const y = top + cell * i;
    root.append(svg("text", { x: left - 6, y: y + cell * 0.7, "text-anchor": "end", class: "target" },
                    target[a.target_index] ?? ""));
    a.weights.forEach((w, j) => {
      const shade = Math.round(255 * (1 - w));
      const rect = svg("rect", { x: left + cell * j, y, width: cell - 1, height: cell - 1,
                                 fill: `rgb(${shade},${shade},${Math.min(255, shade + 40)})`, class: "cell" });
      rect.append(svg("title", {}, `${target[a.target_index]} \u2192 ${source[j]}: ${w.toFixed(3)}`));
      root.append(rect);
    });
  });
  $("heatmap").replaceChildren(root);
}

function showFinal(translation, placeholders) {
  $("partial").textContent = "";
  const list = $("hypotheses");
  list.replaceChildren();
  translation.hypotheses.forEach((h, k) => {
    const item = document.createElement("li");
    item.append(Object.assign(document.createElement("span"), { className: "text", textContent: h.text }));
    item.append(Object.assign(document.createElement("span"), { className: "score", textContent: `score ${h.score.toFixed(3)}` }));
    item.addEventListener("click", () => choose(k));
    list.append(item);
  });
  const choose = (k) => {
    [...list.children].forEach((li, i) => li.classList.toggle("chosen", i === k));
    $("heatmap-of").textContent = `(hypothesis ${k + 1})`;
    drawHeatmap(translation, translation.hypotheses[k], placeholders);
  };
  choose(0);
}

async function translate(event) {
  event.preventDefault();
  const text = $("text").value;
  const placeholders = findPlaceholders(text);
  showError("");
  $("translate").disabled = true;
  $("status").textContent = "translating\u2026";
  $("result").hidden = false;
  $("hypotheses").replaceChildren();
  $("heatmap").replaceChildren();
  const started = performance.now();
  let by = "";
  try {
    await postEvents("/v1/translate:stream", request(text), (name, data) => {
      if (name === "partial") $("partial").textContent = data.translations[0].hypotheses[0].text;
      else if (name === "final") showFinal(data.translations[0], placeholders);
      else if (name === "error") throw new Error(`${data.code}: ${data.message}`);
      if (name === "final") by = ` by ${data.model} version ${data.model_version}`;
    });
    $("status").textContent = `translated${by} in ${Math.round(performance.now() - started)} ms`;
  } catch (e) {
    $("status").textContent = "";
    showError(e.message);
  } finally {
    $("translate").disabled = false;
  }
}

window.nmt = { findPlaceholders, showPiece, NAMES };
document.addEventListener("DOMContentLoaded", () => {
  $("form").addEventListener("submit", translate);
  $("access").addEventListener("submit", useToken);
  $("token").value = sessionStorage.getItem(TOKEN_KEY) ?? "";
  $("source").addEventListener("change", () => pickLanguages($("source").value, $("target").value));
  $("target").addEventListener("change", () => pickLanguages($("source").value, $("target").value));
  $("swap").addEventListener("click", () => pickLanguages($("target").value, $("source").value));
  $("model").addEventListener("change", pickModel);
  loadModels().catch((e) => showError(`models: ${e.message}`));
});
