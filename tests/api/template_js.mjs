// Builds templates with the npm e2b SDK (path in $E2B_JS_SDK) against our API; prints one
// JSON line of results for tests/api/test_template_js.py. argv: the COPY context dir.
const { Template, Sandbox, waitForPort } = await import(process.env.E2B_JS_SDK);
const [context] = process.argv.slice(2);
const out = {};
const t = Template({ fileContextPath: context })
  .fromTemplate("base")
  .runCmd("echo hi")
  .copy("a.txt", "/app/")
  .setEnvs({ A: "1" })
  .setWorkdir("/app")
  .setUser("user")
  .setStartCmd("python3 -m http.server 8000", waitForPort(8000));
const logs = [];
const info = await Template.build(t, "js-tpl:v1", { onBuildLogs: (e) => logs.push(e.message) });
out.info = { templateId: info.templateId, buildId: info.buildId, tags: info.tags };
out.logs = logs;
out.exists = await Template.exists("js-tpl:v1");
const sbx = await Sandbox.create("js-tpl:v1", { envs: { A: "mine" } });
out.sandboxTemplate = (await sbx.getInfo()).templateId;
await sbx.kill();
try {
  await Template.build(Template().fromTemplate("base").runCmd("exit 1"), "js-bad");
  out.failed = null;
} catch (e) {
  out.failed = { name: e.name, message: e.message };
}
try {
  await Template.build(Template().fromTemplate("nope"), "js-orphan");
  out.missing = null;
} catch (e) {
  out.missing = { name: e.name, message: e.message };
}
console.log(JSON.stringify(out));
