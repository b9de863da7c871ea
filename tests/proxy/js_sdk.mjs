// Drives the npm e2b SDK (path in $E2B_JS_SDK) against our API + proxy; prints one JSON
// line of results for tests/proxy/test_js_sdk.py. Sandbox ids come in argv.
const { Sandbox } = await import(process.env.E2B_JS_SDK);
const [runningId, pausedId] = process.argv.slice(2);
const out = {};
const page = Sandbox.list({ query: { metadata: { "team name": "x/y&z" } }, limit: 1 });
out.listed = [];
while (page.hasNext) out.listed.push(...(await page.nextItems()).map((s) => s.sandboxId));
const info = await Sandbox.getInfo(runningId);
out.info = { id: info.sandboxId, state: info.state, envdVersion: info.envdVersion };
await Sandbox.setTimeout(runningId, 60_000);
out.pausePaused = await Sandbox.pause(pausedId); // 409 -> false
try { await Sandbox.getInfo("inope"); out.notFound = "no error"; } catch (e) { out.notFound = e.name; }
out.killUnknown = await Sandbox.kill("inope"); // 404 -> false
const sbx = await Sandbox.connect(runningId);
const lines = [];
const res = await sbx.commands.run("echo one; sleep 0.2; echo two", { onStdout: (d) => lines.push(d) });
out.run = { exitCode: res.exitCode, stdout: res.stdout, chunks: lines.length };
await sbx.files.write("/tmp/aenv-js-proxy-test.txt", "via proxy");
out.file = await sbx.files.read("/tmp/aenv-js-proxy-test.txt");
await sbx.files.remove("/tmp/aenv-js-proxy-test.txt");
out.killed = await sbx.kill();
console.log(JSON.stringify(out));
