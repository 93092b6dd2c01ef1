// MinT dashboard: live training curves (uPlot) and the engine panel. No build step; plain ES2017.
(function () {
  "use strict";

  // Which chart a metric belongs on. Names are the server's (`loss:sum`, `kl_sample_train_v1:mean`,
  // `grad_norm:mean`) or whatever the client reported (`reward`, `env/reward/mean`, ...).
  function chartOf(name, reported) {
    var n = name.toLowerCase();
    if (n.indexOf("reward") >= 0 || n.indexOf("correct") >= 0 || n.indexOf("accuracy") >= 0) return "reward";
    if (n.indexOf("kl") >= 0) return "kl";
    if (n.indexOf("loss") >= 0) return "loss";
    if (reported) return "reward";
    return "optim";
  }

  var STEP_TICKS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000];
  var PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4b5563", "#db2777"];

  function Curves(root) {
    this.root = root;
    this.run = root.getAttribute("data-run");
    this.pollMs = parseInt(root.getAttribute("data-poll-ms") || "2000", 10);
    this.after = 0;
    this.steps = {};       // step -> {metric name -> value}
    this.names = {};       // chart -> {metric name -> true}
    this.charts = {};      // chart -> uPlot
    window.mintCharts = this.charts;
    window.mintSteps = this.steps;
  }

  Curves.prototype.add = function (records) {
    for (var i = 0; i < records.length; i++) {
      var r = records[i], values = r.metrics || r.reported || {}, reported = !r.metrics;
      var row = this.steps[r.step] || (this.steps[r.step] = {});
      for (var name in values) {
        row[name] = values[name];
        var chart = chartOf(name, reported);
        (this.names[chart] || (this.names[chart] = {}))[name] = true;
      }
    }
  };

  Curves.prototype.draw = function () {
    var steps = Object.keys(this.steps).map(Number).sort(function (a, b) { return a - b; });
    document.getElementById("step-count").textContent = String(steps.length);
    var self = this;
    Array.prototype.forEach.call(this.root.querySelectorAll("[data-chart]"), function (box) {
      var chart = box.getAttribute("data-chart"), names = Object.keys(self.names[chart] || {}).sort();
      if (!names.length) return;
      var data = [steps].concat(names.map(function (n) {
        return steps.map(function (s) { var v = self.steps[s][n]; return v === undefined ? null : v; });
      }));
      var u = self.charts[chart];
      if (u && u.series.length === names.length + 1) { u.setData(data); return; }
      if (u) u.destroy();  // a new metric appeared: draw the chart again with it
      var empty = box.querySelector(".empty");
      if (empty) empty.remove();
      // A learning rate is orders of magnitude below a gradient norm: it gets its own axis, on the right.
      var own = function (n) { return n.indexOf("learning_rate") === 0; };
      var axes = [{ label: "step", incrs: STEP_TICKS }, {}];
      if (names.some(own)) axes.push({ scale: "lr", side: 1, grid: { show: false } });
      var opts = {
        width: Math.max(320, box.clientWidth - 8), height: 220,
        scales: { x: { time: false } },
        axes: axes,
        series: [{ label: "step" }].concat(names.map(function (n, i) {
          return { label: n, scale: own(n) ? "lr" : "y", stroke: PALETTE[i % PALETTE.length], width: 2,
                   spanGaps: true, points: { show: steps.length < 60 } };
        })),
      };
      self.charts[chart] = new uPlot(opts, data, box);
    });
  };

  Curves.prototype.poll = function () {
    var self = this;
    fetch("/dashboard/api/runs/" + encodeURIComponent(this.run) + "/metrics?after=" + this.after,
          { credentials: "same-origin", cache: "no-store" })
      .then(function (r) { if (!r.ok) throw new Error("HTTP " + r.status); return r.json(); })
      .then(function (body) {
        if (body.records.length) { self.add(body.records); self.draw(); }
        self.after = body.next;
      })
      .catch(function () { /* the next poll tries again */ })
      .then(function () { setTimeout(function () { self.poll(); }, self.pollMs); });
  };

  function pollEngine(section) {
    var ms = parseInt(section.getAttribute("data-poll-ms") || "5000", 10);
    function tick() {
      fetch("/dashboard/api/engine", { credentials: "same-origin", cache: "no-store" })
        .then(function (r) { if (!r.ok) throw new Error("HTTP " + r.status); return r.json(); })
        .then(function (body) {
          Array.prototype.forEach.call(section.querySelectorAll("[data-field]"), function (el) {
            var v = el.getAttribute("data-field").split(".").reduce(function (o, k) { return o == null ? o : o[k]; }, body);
            if (v !== undefined && v !== null) el.textContent = typeof v === "number" ? String(Math.round(v)) : String(v);
          });
        })
        .catch(function () {})
        .then(function () { setTimeout(tick, ms); });
    }
    setTimeout(tick, ms);
  }

  document.addEventListener("DOMContentLoaded", function () {
    var charts = document.getElementById("charts");
    if (charts) new Curves(charts).poll();
    var engine = document.getElementById("engine");
    if (engine) pollEngine(engine);
  });
})();
