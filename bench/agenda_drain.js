// agenda_drain.js -- Agenda 5, the Node.js job scheduler on MongoDB, draining N no-op jobs on
// the same server as relaybus's MongoDB drain (bench/run.sh runs it beside bench/drain.lua).
//   MONGO_URL=mongodb://HOST:PORT/DB N=5000 C=64 node agenda_drain.js
// Prints: agenda N jobs in S s = R jobs/s (processEvery 100 ms, concurrency C)
// The jobs are inserted in one insertMany, as Agenda's own documents (the way agenda.now()
// writes them, without its one round trip per job), then one Agenda instance runs them with
// processEvery 100 ms and maxConcurrency = defaultConcurrency = C, no lock limit (with
// lockLimit = C it stopped after its first C jobs on FerretDB 1.24). A job counts when its
// handler has run.
const { Agenda } = require("agenda");

const url = process.env.MONGO_URL;
const N = parseInt(process.env.N || "5000", 10);
const C = parseInt(process.env.C || "64", 10);
if (!url) {
  console.error("agenda_drain: MONGO_URL is not set");
  process.exit(2);
}

async function main() {
  const collection = "agenda_bench_" + Date.now();
  const agenda = new Agenda({
    db: { address: url, collection },
    processEvery: "100 milliseconds",
    maxConcurrency: C,
    defaultConcurrency: C,
  });
  let done = 0;
  let finished;
  const all = new Promise((resolve) => { finished = resolve; });
  agenda.define("noop", { concurrency: C }, async () => {
    done += 1;
    if (done === N) finished();
  });
  await agenda._ready;
  const now = new Date();
  const jobs = [];
  for (let i = 0; i < N; i++) {
    jobs.push({ name: "noop", data: { i }, type: "normal", priority: 0, nextRunAt: now,
                lastModifiedBy: null });
  }
  await agenda._collection.insertMany(jobs, { ordered: false });
  const t0 = process.hrtime.bigint();
  await agenda.start();
  const limit = setTimeout(() => {
    console.error(`agenda_drain: ${done} of ${N} ran within the time limit`);
    process.exit(1);
  }, 600000);
  await all;
  const s = Number(process.hrtime.bigint() - t0) / 1e9;
  clearTimeout(limit);
  await agenda.stop();
  await agenda._collection.drop().catch(() => {});
  console.log(`agenda ${N} jobs in ${s.toFixed(2)} s = ${Math.round(N / s)} jobs/s` +
              ` (processEvery 100 ms, concurrency ${C})`);
  process.exit(0);
}

main().catch((e) => {
  console.error("agenda_drain:", e && e.message ? e.message : e);
  process.exit(1);
});
