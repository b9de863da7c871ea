// The npm e2b SDK's volumes against the real service (real VMs): a volume written from the
// host API, mounted in two sandboxes, each reading the other's writes, a pause + resume,
// and destroy. Prints one JSON line for tests/e2e/test_volumes.py. argv: volume name.
import { Sandbox, Volume } from "e2b";

const [name] = process.argv.slice(2);
const out = {};
const made = [];
try {
  const vol = await Volume.create(name);
  out.created = { name: vol.name, hasToken: Boolean(vol.token) };
  await vol.writeFile("/from-js.txt", "written by the js SDK\n");
  const a = await Sandbox.create({ volumeMounts: { "/mnt/js": vol }, timeoutMs: 600_000 });
  made.push(a);
  const b = await Sandbox.create({ volumeMounts: { "/vol": name }, timeoutMs: 600_000 });
  made.push(b);
  out.info = (await a.getInfo()).volumeMounts;
  out.readInA = (await a.commands.run("cat /mnt/js/from-js.txt")).stdout;
  await a.commands.run("echo from-a > /mnt/js/a.txt");
  out.readInB = (await b.commands.run("cat /vol/a.txt")).stdout;
  out.readByApi = await vol.readFile("/a.txt");
  out.listed = (await vol.list("/")).map((e) => `${e.path}:${e.type}`).sort();
  await a.pause();
  const a2 = await Sandbox.connect(a.sandboxId);
  await a2.commands.run("echo after-resume >> /mnt/js/a.txt");
  out.afterResume = (await b.commands.run("cat /vol/a.txt")).stdout;
  out.listedVolumes = (await Volume.list()).filter((v) => v.name === name).length;
  out.destroyed = await Volume.destroy(vol.volumeId);
  out.destroyedAgain = await Volume.destroy(vol.volumeId);
  try {
    await Sandbox.create({ volumeMounts: { "/x": "no-such-volume" } });
    out.unknown = "created";
  } catch (e) {
    out.unknown = `${e.name}: ${e.message}`;
  }
} catch (e) {
  out.error = `${e.name}: ${e.message}`;
} finally {
  for (const s of made) await s.kill().catch(() => {});
}
console.log(JSON.stringify(out));
