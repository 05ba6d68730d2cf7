// kvloop's web view of the scheduler loop: plain JavaScript, no dependencies.
// NOTE: text from traces and requests is only ever set with textContent (or drawn on a
// canvas), never parsed as HTML.
"use strict";
(() => {
  const MODE = document.querySelector('meta[name="kvloop-mode"]').content;
  const $ = (id) => document.getElementById(id);
  const LIVE_MAX_STEPS = 2000;
  const MAX_ROWS = 400;
  const STATES = ["", "waiting", "prefill", "recompute", "decode", "stalled", "preempted",
    "swapped"];
  const CODE = Object.fromEntries(STATES.map((s, i) => [s, i]));
  const COLORS = ["#ffffff", "#dedee3", "#3b78d8", "#e8912d", "#3aa757", "#bfe3c8", "#d93025",
    "#8e5bd6"];
  const STATE_WORDS = {
    waiting: "waiting", prefill: "prefill chunk", recompute: "recompute (prefill again)",
    decode: "decode token", stalled: "running, not scheduled", preempted: "preempted",
    swapped: "swapped out",
  };
  const KV_COLORS = { used: "#3a5f8f", shared: "#2bb3a3", cached: "#b8d4f0", free: "#f2f2f4",
    host: "#8e5bd6" };

  let words = { reasons: {}, causes: {} };
  let records = [];
  let model = null;
  let sel = 0;
  let win = null; // [s0, s1) of record indices shown in the lanes
  let timer = null;
  let dirty = false;
  let prompts = {};

  // -- the model: per request, a state per step ------------------------------------------
  function build(recs) {
    const reqs = new Map();
    const order = [];
    const status = new Map();
    const active = new Set();
    const series = { running: [], waiting: [], swapped: [], kv: [], itl: [],
      ttft: [], ttftAt: [] };
    const ttfts = [];
    const itls = [];
    const preemptions = [];
    const get = (rid, i) => {
      let q = reqs.get(rid);
      if (!q) {
        q = { id: rid, first: i, end: null, cells: [], arrival: null, prompt: null,
          finish: null, firstToken: null, lastToken: null, preemptions: 0 };
        reqs.set(rid, q);
        order.push(q);
        active.add(rid);
        status.set(rid, "waiting");
      }
      return q;
    };
    recs.forEach((r, i) => {
      for (const [rid, t, p] of r.arrived) {
        const q = get(rid, i);
        q.arrival = t;
        q.prompt = p;
      }
      const sched = new Map();
      for (const e of r.scheduled) {
        sched.set(e.request_id, e);
        get(e.request_id, i);
        status.set(e.request_id, "running");
      }
      for (const rid of r.swapped_in) status.set(rid, "running");
      for (const rid of active) {
        const q = reqs.get(rid);
        const e = sched.get(rid);
        const s = status.get(rid);
        q.cells[i - q.first] = e ? CODE[e.kind] || CODE.decode
          : CODE[s === "running" ? "stalled" : s];
      }
      r.preempted.forEach(([rid, mode], k) => {
        preemptions.push([i, rid, mode, (r.preempt_causes || [])[k]]);
      });
      for (const [rid, mode] of r.preempted) {
        const q = get(rid, i);
        q.cells[i - q.first] = CODE.preempted;
        q.preemptions += 1;
        status.set(rid, mode === "swap" ? "swapped" : "waiting");
      }
      let gaps = 0;
      let ngaps = 0;
      for (const rid of r.sampled) {
        const q = reqs.get(rid);
        if (!q) continue;
        if (q.firstToken === null) {
          q.firstToken = r.end_time_s;
          if (q.arrival !== null) {
            ttfts.push(r.end_time_s - q.arrival);
            series.ttft.push(r.end_time_s - q.arrival);
            series.ttftAt.push(i);
          }
        } else {
          const g = r.end_time_s - q.lastToken;
          itls.push(g);
          gaps += g;
          ngaps += 1;
        }
        q.lastToken = r.end_time_s;
      }
      for (const [rid, why] of r.finished) {
        const q = get(rid, i);
        q.end = i;
        q.finish = why;
        active.delete(rid);
      }
      series.running.push(r.num_running);
      series.waiting.push(r.num_waiting);
      series.swapped.push(r.num_swapped);
      series.kv.push(r.num_gpu_blocks ? r.kv_blocks_used / r.num_gpu_blocks : 0);
      series.itl.push(ngaps ? gaps / ngaps : null);
    });
    return { reqs, order, series, ttfts, itls, preemptions };
  }

  function pct(values, p) {
    if (!values.length) return null;
    const s = values.slice().sort((a, b) => a - b);
    return s[Math.min(s.length - 1, Math.max(0, Math.ceil((p / 100) * s.length) - 1))];
  }

  const ms = (s) => (s === null ? "–" : `${(s * 1000).toFixed(s < 0.1 ? 1 : 0)} ms`);
  const reason = (code) => words.reasons[code] || code;
  const cause = (code) => words.causes[code] || code;

  // -- the selected step -----------------------------------------------------------------
  function el(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined) e.textContent = text;
    if (cls) e.className = cls;
    return e;
  }

  function preemptWhy(rid, c) {
    if (!c) return "";
    if (c[2] === rid) {
      return ": no free KV block for its own next tokens, and it was the least urgent";
    }
    return `: ${cause(c[1])}${c[2] ? ` ${c[2]}` : ""}`;
  }

  function describe(r) {
    const out = [];
    const add = (text, cls) => out.push([text, cls || ""]);
    for (const [rid, , p] of r.arrived) add(`Arrived ${rid} (${p} prompt tokens).`, "arrive");
    for (const [rid, n, hit] of r.admitted || []) {
      add(`Admitted ${rid}: ${n} tokens scheduled` +
        (hit ? `, ${hit} found in the prefix cache.` : "."), "admit");
    }
    for (const rid of r.swapped_in) add(`Swapped in ${rid}.`, "admit");
    const causes = r.preempt_causes || [];
    r.preempted.forEach(([rid, mode], k) => {
      add(`Preempted ${rid} by ${mode}${preemptWhy(rid, causes[k])}.`, "preempt");
    });
    for (const [rid, why] of r.left_out || []) add(`Left out ${rid}: ${reason(why)}.`, "held");
    for (const [rid, why] of r.held || []) add(`Left waiting ${rid}: ${reason(why)}.`, "held");
    if (r.num_held_behind) {
      const n = r.num_held_behind;
      const what = n === 1 ? "1 more request" : `${n} more requests`;
      if ((r.held || []).length) {
        add(`${what} left waiting behind, in policy order.`, "held");
      } else {
        add(`${what} left waiting: ${reason(r.held_reason)}.`, "held");
      }
    }
    for (const [rid, why] of r.finished) add(`Finished ${rid} (${why}).`, "finish");
    if (r.prefix_cache_queries) {
      add(`Prefix cache: ${r.prefix_cache_hits} of ${r.prefix_cache_queries} prompt tokens hit.`);
    }
    if (!out.length) add("No admissions, refusals or preemptions: the batch went on.");
    return out;
  }

  function renderStep() {
    if (!records.length) return;
    const r = records[sel];
    const t0 = records[0].time_s;
    $("step-number").textContent = String(r.step);
    $("step-time").textContent =
      `at ${(r.time_s - t0).toFixed(3)} s, took ${ms(r.step_time_s)}`;
    $("step-label").textContent = `step ${r.step} (${sel + 1} of ${records.length})`;
    $("slider").max = String(records.length - 1);
    $("slider").value = String(sel);
    // batch
    let pre = 0;
    let dec = 0;
    let npre = 0;
    let ndec = 0;
    const body = $("batch-table").tBodies[0];
    body.replaceChildren();
    for (const e of r.scheduled) {
      if (e.kind === "decode") { dec += e.num_tokens; ndec += 1; } else {
        pre += e.num_tokens; npre += 1;
      }
      const tr = el("tr");
      tr.dataset.request = e.request_id;
      for (const v of [e.request_id, e.kind, e.num_tokens, e.num_computed_tokens]) {
        tr.append(el("td", String(v)));
      }
      body.append(tr);
    }
    const budget = Math.max(r.token_budget, r.num_batched_tokens, 1);
    const bar = $("batch-bar");
    bar.replaceChildren();
    for (const [n, color, title] of [[pre, COLORS[CODE.prefill], "prefill"],
      [dec, COLORS[CODE.decode], "decode"]]) {
      const d = el("div");
      d.style.width = `${(100 * n) / budget}%`;
      d.style.background = color;
      d.title = `${title}: ${n} tokens`;
      bar.append(d);
    }
    const s = $("batch-summary");
    s.textContent = `${ndec} decode${ndec === 1 ? "" : "s"} (${dec} tokens) + ${npre} ` +
      `prefill chunk${npre === 1 ? "" : "s"} (${pre} tokens) = ${r.num_batched_tokens} of ` +
      `${r.token_budget} budget tokens`;
    Object.assign(s.dataset, { decodes: ndec, prefills: npre, tokens: r.num_batched_tokens,
      budget: r.token_budget });
    renderKV(r);
    const ul = $("decisions");
    ul.replaceChildren(...describe(r).map(([text, cls]) => el("li", text, cls)));
    drawLanes();
    drawCharts();
    renderPreemptions();
  }

  function kvCounts(r) {
    const total = r.num_gpu_blocks;
    const used = r.kv_blocks_used;
    const bs = r.block_size || 0;
    const shared = bs ? Math.min(used, Math.floor(r.prefix_cache_hits / bs)) : 0;
    const cached = Math.min(total - used, Math.max(0, (r.kv_cached_blocks || 0) - used));
    return { total, used, shared, cached, free: total - used - cached,
      host: r.host_blocks_used || 0, hostTotal: r.num_host_blocks || 0 };
  }

  function renderKV(r) {
    const k = kvCounts(r);
    const p = $("kv-summary");
    p.textContent = `${k.used} of ${k.total} blocks used (${Math.round((100 * k.used) /
      Math.max(k.total, 1))}%), ${k.shared} of them prefix hits this step; ${k.cached} free ` +
      `holding cached prefixes; ${k.free} free. This step: +${r.kv_blocks_allocated || 0} ` +
      `allocated, −${r.kv_blocks_freed || 0} freed` +
      (k.hostTotal ? `; ${k.host} of ${k.hostTotal} host blocks hold swapped-out requests.`
        : ".");
    Object.assign(p.dataset, { used: k.used, total: k.total, free: k.free, cached: k.cached,
      host: k.host });
    const c = $("kv-grid");
    const cols = Math.max(8, Math.min(64, Math.ceil(Math.sqrt(k.total * 4))));
    const shown = Math.min(k.total, cols * 40);
    const scale = k.total / Math.max(shown, 1);
    const size = Math.max(3, Math.min(14, Math.floor(440 / cols)));
    c.width = cols * size;
    c.height = Math.ceil(shown / cols) * size;
    const g = c.getContext("2d");
    g.clearRect(0, 0, c.width, c.height);
    for (let i = 0; i < shown; i += 1) {
      const b = Math.floor(i * scale);
      g.fillStyle = b < k.shared ? KV_COLORS.shared : b < k.used ? KV_COLORS.used
        : b < k.used + k.cached ? KV_COLORS.cached : KV_COLORS.free;
      g.fillRect((i % cols) * size, Math.floor(i / cols) * size, size - 1, size - 1);
    }
    c.title = scale > 1 ? `one cell: ${scale.toFixed(1)} blocks` : "one cell: one block";
    const host = $("kv-host");
    host.hidden = !k.hostTotal;
    host.replaceChildren();
    if (k.hostTotal) {
      const d = el("div");
      d.style.width = `${(100 * k.host) / k.hostTotal}%`;
      d.style.background = KV_COLORS.host;
      host.append(d);
      host.title = `host tier: ${k.host} of ${k.hostTotal} blocks hold swapped-out requests`;
    }
  }

  // -- request lanes ---------------------------------------------------------------------
  function visibleRows() {
    const [s0, s1] = win;
    return model.order.filter((q) => q.first < s1 && (q.end === null || q.end >= s0))
      .slice(0, MAX_ROWS);
  }

  function drawLanes() {
    const c = $("lanes");
    const [s0, s1] = win;
    const rows = visibleRows();
    const rowH = Math.max(3, Math.min(14, Math.floor(420 / Math.max(rows.length, 1))));
    const label = rowH >= 9 ? 90 : 0;
    const dpr = window.devicePixelRatio || 1;
    const width = c.clientWidth || 600;
    c.style.height = `${rows.length * rowH + 4}px`;
    c.width = width * dpr;
    c.height = (rows.length * rowH + 4) * dpr;
    const g = c.getContext("2d");
    g.scale(dpr, dpr);
    g.clearRect(0, 0, width, rows.length * rowH + 4);
    const plot = width - label;
    const n = s1 - s0;
    const ncols = Math.max(1, Math.min(n, Math.floor(plot)));
    const cw = plot / ncols;
    g.font = `${Math.min(11, rowH - 1)}px system-ui, sans-serif`;
    g.textBaseline = "middle";
    rows.forEach((q, y) => {
      if (label) {
        g.fillStyle = "#444";
        g.fillText(q.id.length > 13 ? `${q.id.slice(0, 12)}…` : q.id, 2, y * rowH + rowH / 2);
      }
      for (let x = 0; x < ncols; x += 1) {
        const i = s0 + Math.floor((x * n) / ncols);
        const v = q.cells[i - q.first];
        if (!v) continue;
        g.fillStyle = COLORS[v];
        g.fillRect(label + x * cw, y * rowH, Math.max(cw - (cw > 3 ? 1 : 0), 1), rowH - 1);
      }
      if (q.end !== null && q.end >= s0 && q.end < s1) {
        g.fillStyle = "#111";
        g.fillRect(label + ((q.end - s0 + 1) * plot) / n - 2, y * rowH, 2, rowH - 1);
      }
    });
    if (sel >= s0 && sel < s1) {
      g.strokeStyle = "#000";
      g.lineWidth = 1;
      const x = label + ((sel - s0 + 0.5) * plot) / n;
      g.beginPath();
      g.moveTo(x, 0);
      g.lineTo(x, rows.length * rowH + 4);
      g.stroke();
    }
    c.dataset.rows = String(rows.length);
    c.dataset.label = String(label);
    $("lanes-window").textContent = `steps ${records[s0].step}–${records[s1 - 1].step}, ` +
      `${rows.length} requests` + (rows.length === MAX_ROWS ? " (first shown)" : "");
  }

  function zoom(factor, center) {
    const n = records.length;
    const [s0, s1] = win;
    const span = Math.max(10, Math.min(n, Math.round((s1 - s0) * factor)));
    const mid = center === undefined ? sel : center;
    const a = Math.max(0, Math.min(n - span, Math.round(mid - span / 2)));
    win = [a, a + span];
    render();
  }

  // -- time series -----------------------------------------------------------------------
  const CHARTS = [
    ["running / waiting / swapped", () => [[model.series.running, "#3aa757"],
      [model.series.waiting, "#888"], [model.series.swapped, "#8e5bd6"]]],
    ["KV blocks used (fraction)", () => [[model.series.kv, "#3a5f8f"]]],
    ["TTFT (s), at each first token", () => [[null, "#e8912d"]]],
    ["mean ITL (s) of the step's tokens", () => [[model.series.itl, "#3b78d8"]]],
  ];

  function setupCharts() {
    const box = $("charts");
    CHARTS.forEach(([title], k) => {
      const f = el("figure");
      const c = el("canvas");
      c.id = `chart-${k}`;
      c.addEventListener("click", (ev) => {
        const rect = c.getBoundingClientRect();
        select(Math.floor(((ev.clientX - rect.left) / rect.width) * records.length));
      });
      f.append(el("figcaption", title), c);
      box.append(f);
    });
  }

  function drawCharts() {
    const n = records.length;
    CHARTS.forEach(([, lines], k) => {
      const c = $(`chart-${k}`);
      const w = c.clientWidth || 300;
      const h = c.clientHeight || 110;
      c.width = w;
      c.height = h;
      const g = c.getContext("2d");
      g.clearRect(0, 0, w, h);
      const ls = lines();
      let max = 0;
      const scatter = ls[0][0] === null;
      const ys = scatter ? model.series.ttft : null;
      for (const [v] of ls) for (const y of v || ys) if (y > max) max = y;
      max = max || 1;
      g.fillStyle = "#888";
      g.font = "10px system-ui, sans-serif";
      g.fillText(max < 10 ? max.toPrecision(2) : String(Math.round(max)), 2, 10);
      if (scatter) {
        g.fillStyle = ls[0][1];
        ys.forEach((y, j) => {
          g.fillRect((model.series.ttftAt[j] / n) * w - 1, h - (y / max) * (h - 12) - 1, 3, 3);
        });
      } else {
        for (const [v, color] of ls) {
          g.strokeStyle = color;
          g.beginPath();
          let pen = false;
          v.forEach((y, i) => {
            if (y === null) { pen = false; return; }
            const x = ((i + 0.5) / n) * w;
            const yy = h - (y / max) * (h - 12);
            if (pen) g.lineTo(x, yy); else g.moveTo(x, yy);
            pen = true;
          });
          g.stroke();
        }
      }
      g.strokeStyle = "#d93025";
      g.beginPath();
      g.moveTo(((sel + 0.5) / n) * w, 0);
      g.lineTo(((sel + 0.5) / n) * w, h);
      g.stroke();
    });
    const p = $("percentiles");
    const t = model.ttfts;
    const i = model.itls;
    p.textContent = `TTFT p50 ${ms(pct(t, 50))} · p90 ${ms(pct(t, 90))} · p99 ${ms(pct(t, 99))}` +
      ` (${t.length} requests)   ITL p50 ${ms(pct(i, 50))} · p90 ${ms(pct(i, 90))} · p99 ` +
      `${ms(pct(i, 99))}`;
  }

  function renderPreemptions() {
    const ul = $("preemptions");
    const last = model.preemptions.slice(-10).reverse();
    if (!last.length) {
      ul.replaceChildren(el("li", "none in these steps"));
      return;
    }
    ul.replaceChildren(...last.map(([i, rid, mode, c]) => {
      const li = el("li", `step ${records[i].step}: ${rid} by ${mode}${preemptWhy(rid, c)}`);
      li.addEventListener("click", () => select(i));
      return li;
    }));
  }

  // -- navigation --------------------------------------------------------------------------
  function select(i) {
    if (!records.length) return;
    sel = Math.max(0, Math.min(records.length - 1, i));
    const [s0, s1] = win;
    if (sel < s0 || sel >= s1) {
      const span = s1 - s0;
      const a = Math.max(0, Math.min(records.length - span, sel - Math.floor(span / 2)));
      win = [a, a + span];
    }
    if (MODE === "live" && sel < records.length - 1) $("follow").checked = false;
    renderStep();
  }

  const isPreemption = (r) => r.preempted.length > 0;
  const isRefusal = (r, i) => (r.held || []).length > 0 &&
    (i === 0 || JSON.stringify(r.held) !== JSON.stringify(records[i - 1].held || []));

  function seek(test, dir) {
    for (let i = sel + dir; i >= 0 && i < records.length; i += dir) {
      if (test(records[i], i)) { select(i); return true; }
    }
    $("status").textContent = "none found";
    return false;
  }

  function play() {
    if (timer) {
      clearInterval(timer);
      timer = null;
      $("play").textContent = "▶ play";
      return;
    }
    $("play").textContent = "⏸ pause";
    timer = setInterval(() => {
      if (sel >= records.length - 1) { play(); return; }
      select(sel + Math.max(1, Math.floor(records.length / 400)));
    }, 100);
  }

  function render() {
    dirty = false;
    renderStep();
  }

  function wire() {
    $("mode-label").textContent = MODE === "live" ? "live dashboard" : "trace view";
    $("follow-wrap").hidden = MODE !== "live";
    $("slider").addEventListener("input", (e) => select(Number(e.target.value)));
    $("first").onclick = () => select(0);
    $("last").onclick = () => select(records.length - 1);
    $("back").onclick = () => select(sel - 1);
    $("forward").onclick = () => select(sel + 1);
    $("play").onclick = play;
    $("next-preemption").onclick = () => seek(isPreemption, 1);
    $("prev-preemption").onclick = () => seek(isPreemption, -1);
    $("next-refusal").onclick = () => seek(isRefusal, 1);
    $("prev-refusal").onclick = () => seek(isRefusal, -1);
    $("zoom-in").onclick = () => zoom(0.5);
    $("zoom-out").onclick = () => zoom(2);
    $("zoom-all").onclick = () => { win = [0, records.length]; render(); };
    const lanes = $("lanes");
    const stepAt = (ev) => {
      const rect = lanes.getBoundingClientRect();
      const label = Number(lanes.dataset.label || 0);
      const f = (ev.clientX - rect.left - label) / (rect.width - label);
      return win[0] + Math.floor(Math.max(0, Math.min(0.9999, f)) * (win[1] - win[0]));
    };
    lanes.addEventListener("click", (ev) => select(stepAt(ev)));
    lanes.addEventListener("wheel", (ev) => {
      ev.preventDefault();
      zoom(ev.deltaY < 0 ? 0.7 : 1.4, stepAt(ev));
    }, { passive: false });
    document.addEventListener("keydown", (ev) => {
      if (ev.target.tagName === "INPUT" && ev.target.type !== "range") return;
      if (ev.key === "ArrowLeft") { select(sel - 1); ev.preventDefault(); }
      if (ev.key === "ArrowRight") { select(sel + 1); ev.preventDefault(); }
      if (ev.key === " ") { play(); ev.preventDefault(); }
    });
    const legend = $("lanes-legend");
    for (const s of STATES.slice(1)) {
      const span = el("span", STATE_WORDS[s]);
      const i = el("i");
      i.style.background = COLORS[CODE[s]];
      span.prepend(i);
      legend.append(span);
    }
    const fin = el("span", "finished");
    const fi = el("i");
    fi.style.background = "#111";
    fin.prepend(fi);
    legend.append(fin);
    const kl = $("kv-legend");
    for (const [k, text] of [["used", "used"], ["shared", "prefix hit this step"],
      ["cached", "free, cached prefix"], ["free", "free"], ["host", "host: swapped out"]]) {
      const span = el("span", text);
      const i = el("i");
      i.style.background = KV_COLORS[k];
      span.prepend(i);
      kl.append(span);
    }
    setupCharts();
    window.addEventListener("resize", () => records.length && render());
  }

  function load(recs) {
    records = recs;
    model = build(records);
    win = [0, records.length];
    if (records.length > 2000) win = [0, 2000];
    sel = 0;
    render();
  }

  // -- live: server-sent events --------------------------------------------------------------
  function live() {
    const base = document.querySelector('link[rel="stylesheet"]').getAttribute("href")
      .replace(/app\.css$/, "");
    const src = new EventSource(`${base}events${window.location.search}`);
    src.onopen = () => { $("status").textContent = "connected"; };
    src.onerror = () => { $("status").textContent = "disconnected (retrying)"; };
    src.onmessage = (ev) => {
      const msg = JSON.parse(ev.data);
      if (msg.words) words = msg.words;
      if (msg.source) $("source").textContent = msg.source;
      if (msg.prompts) {
        Object.assign(prompts, msg.prompts);
        const ul = $("prompts");
        $("prompts-panel").hidden = false;
        ul.replaceChildren(...Object.entries(prompts).slice(-50)
          .map(([rid, text]) => el("li", `${rid}: ${text}`)));
      }
      if (!msg.records || !msg.records.length) return;
      const wasLast = sel >= records.length - 1;
      records = records.concat(msg.records);
      let dropped = 0;
      if (records.length > LIVE_MAX_STEPS) {
        dropped = records.length - LIVE_MAX_STEPS;
        records = records.slice(dropped);
      }
      model = build(records);
      const span = win ? win[1] - win[0] : records.length;
      if ($("follow").checked || wasLast) {
        sel = records.length - 1;
        win = [Math.max(0, records.length - Math.max(span, Math.min(records.length, 300))),
          records.length];
      } else {
        sel = Math.max(0, sel - dropped);
        win = [Math.max(0, win[0] - dropped), Math.min(records.length, win[1] - dropped)];
        if (win[1] <= win[0]) win = [0, records.length];
      }
      $("status").textContent = `connected · ${records.length} recent steps`;
      if (!dirty) {
        dirty = true;
        requestAnimationFrame(render);
      }
    };
  }

  window.kvloop = {
    get records() { return records; },
    get selected() { return sel; },
    select,
  };

  wire();
  if (MODE === "live") {
    live();
  } else {
    fetch("trace.json").then((r) => {
      if (!r.ok) throw new Error(`trace.json: HTTP ${r.status}`);
      return r.json();
    }).then((doc) => {
      words = doc.words;
      $("source").textContent = doc.source;
      $("status").textContent = `${doc.records.length} steps`;
      load(doc.records);
      document.body.dataset.ready = "1";
    }).catch((err) => { $("status").textContent = `could not load the trace: ${err}`; });
  }
})();
