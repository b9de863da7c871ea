// Drives envd's filesystem.Filesystem and /files with the official e2b JS SDK
// (E2B_DEBUG=true, E2B_SANDBOX_URL = envd under test). Usage: node files.mjs <scratch dir>.
// Run from pytest (tests/envd/test_files_js.py); prints one line per passed check and
// exits non-zero on the first failure.
import assert from 'node:assert/strict'
import { Sandbox, FileNotFoundError, FileType } from 'e2b'

const dir = process.argv[2]
assert.ok(dir, 'scratch directory argument missing')
const sbx = await Sandbox.create()
const sleep = (ms) => new Promise((r) => setTimeout(r, ms))
const check = async (name, fn) => {
  try {
    await fn()
    console.log(`ok ${name}`)
  } catch (err) {
    console.error(`FAIL ${name}: ${err?.stack ?? err}`)
    process.exit(1)
  }
}

await check('write/read', async () => {
  const w = await sbx.files.write(`${dir}/sub/a.txt`, 'hello')
  assert.equal(w.path, `${dir}/sub/a.txt`)
  assert.equal(w.name, 'a.txt')
  assert.equal(await sbx.files.read(`${dir}/sub/a.txt`), 'hello')
  const bytes = await sbx.files.read(`${dir}/sub/a.txt`, { format: 'bytes' })
  assert.deepEqual(Array.from(bytes), Array.from(new TextEncoder().encode('hello')))
  const blob = await sbx.files.read(`${dir}/sub/a.txt`, { format: 'blob' })
  assert.equal(await blob.text(), 'hello')
  await sbx.files.write(`${dir}/empty.txt`, '')
  assert.equal(await sbx.files.read(`${dir}/empty.txt`), '')
})

await check('multi-file write + gzip', async () => {
  await sbx.files.write([
    { path: `${dir}/m1.txt`, data: '1' },
    { path: `${dir}/deep/m2.txt`, data: '2' },
  ])
  assert.equal(await sbx.files.read(`${dir}/deep/m2.txt`), '2')
  const text = 'zipped '.repeat(2000)
  await sbx.files.write(`${dir}/gz.txt`, text, { gzip: true })
  assert.equal(await sbx.files.read(`${dir}/gz.txt`, { gzip: true }), text)
  await sbx.files.write(`${dir}/meta.txt`, 'x', { metadata: { Team: 'js' } })
  assert.deepEqual((await sbx.files.getInfo(`${dir}/meta.txt`)).metadata, { team: 'js' })
})

await check('list/getInfo/exists', async () => {
  const names = (await sbx.files.list(dir)).map((e) => e.name).sort()
  assert.deepEqual(names, ['deep', 'empty.txt', 'gz.txt', 'm1.txt', 'meta.txt', 'sub'])
  const deep = (await sbx.files.list(dir, { depth: 2 })).map((e) => e.path)
  assert.ok(deep.includes(`${dir}/sub/a.txt`))
  const info = await sbx.files.getInfo(`${dir}/sub/a.txt`)
  assert.equal(info.type, FileType.FILE)
  assert.equal(info.size, 5)
  assert.equal(info.owner, 'user')
  assert.equal((await sbx.files.getInfo(`${dir}/sub`)).type, FileType.DIR)
  assert.equal(await sbx.files.exists(`${dir}/m1.txt`), true)
  assert.equal(await sbx.files.exists(`${dir}/nope`), false)
})

await check('makeDir/rename/remove', async () => {
  assert.equal(await sbx.files.makeDir(`${dir}/newdir/x`), true)
  assert.equal(await sbx.files.makeDir(`${dir}/newdir/x`), false)
  const moved = await sbx.files.rename(`${dir}/m1.txt`, `${dir}/newdir/m1.txt`)
  assert.equal(moved.type, FileType.FILE)
  assert.equal(moved.path, `${dir}/newdir/m1.txt`)
  await sbx.files.remove(`${dir}/newdir`)
  assert.equal(await sbx.files.exists(`${dir}/newdir`), false)
  await sbx.files.remove(`${dir}/newdir`) // already gone: done, no error (as E2B)
})

await check('read /proc and /sys files (size 0 or a page)', async () => {
  const bootId = await sbx.files.read('/proc/sys/kernel/random/boot_id')
  assert.equal(bootId.trim().length, 36)
  assert.match(await sbx.files.read('/proc/meminfo'), /^MemTotal:/)
  assert.equal((await sbx.files.read('/sys/class/net/lo/address')).trim(), '00:00:00:00:00:00')
})

await check('not found', async () => {
  await assert.rejects(sbx.files.read(`${dir}/nope`), FileNotFoundError)
  await assert.rejects(sbx.files.getInfo(`${dir}/nope`), FileNotFoundError)
  await assert.rejects(sbx.files.list(`${dir}/nope`), FileNotFoundError)
  await assert.rejects(sbx.files.watchDir(`${dir}/nope`, () => {}), FileNotFoundError)
})

await check('watchDir', async () => {
  const events = []
  const wh = await sbx.files.watchDir(dir, (e) => events.push(e), {
    recursive: true, includeEntry: true, timeoutMs: 30_000,
  })
  await sbx.files.write(`${dir}/sub/watched.txt`, 'x')
  for (let i = 0; i < 50 && !events.some((e) => e.name === 'sub/watched.txt' && e.type === 'write'); i++) {
    await sleep(100)
  }
  await wh.stop()
  const hit = events.find((e) => e.name === 'sub/watched.txt' && e.type === 'write')
  assert.ok(hit, JSON.stringify(events))
  assert.ok(events.some((e) => e.name === 'sub/watched.txt' && e.type === 'create'))
  assert.ok(!events.some((e) => e.name.includes('.envd-upload-')), JSON.stringify(events))
})

console.log('ALL PASSED')
