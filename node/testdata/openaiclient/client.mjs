// The official openai npm client against a clustered kvmesh gateway
// (node/openai_client_test.go starts the cluster and runs one case per
// process): node client.mjs <case>, with KVMESH_GW1 and KVMESH_GW2 the
// base URLs of two gateways of one cluster and KVMESH_MODEL the model.
// Exit status 0 means the case held; a failure prints why.
import OpenAI, { toFile } from "openai";

const model = process.env.KVMESH_MODEL ?? "m";
const client = (url) => new OpenAI({ baseURL: url + "/v1", apiKey: "unused", maxRetries: 0, timeout: 30000 });
const gw1 = client(process.env.KVMESH_GW1);
const gw2 = client(process.env.KVMESH_GW2);

function check(cond, msg) {
  if (!cond) throw new Error("check failed: " + msg);
}

// A 1 x 1 PNG.
const png = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAQAAAC1HAwCAAAAC0lEQVR42mNkYAAAAAYAAjCB0C8AAAAASUVORK5CYII=";

// wav returns a mono 16-bit PCM WAV file of secs seconds at 8 kHz.
function wav(secs) {
  const rate = 8000, n = Math.round(secs * rate);
  const b = Buffer.alloc(44 + 2 * n);
  b.write("RIFF", 0); b.writeUInt32LE(36 + 2 * n, 4); b.write("WAVE", 8);
  b.write("fmt ", 12); b.writeUInt32LE(16, 16); b.writeUInt16LE(1, 20); b.writeUInt16LE(1, 22);
  b.writeUInt32LE(rate, 24); b.writeUInt32LE(2 * rate, 28); b.writeUInt16LE(2, 32); b.writeUInt16LE(16, 34);
  b.write("data", 36); b.writeUInt32LE(2 * n, 40);
  for (let i = 0; i < n; i++) b.writeInt16LE(Math.round(8000 * Math.sin(i / 10)), 44 + 2 * i);
  return b;
}

const cases = {
  async "chat-image"() {
    const r = await gw1.chat.completions.create({
      model, max_tokens: 4,
      messages: [
        { role: "system", content: "You describe pictures." },
        { role: "user", content: [
          { type: "text", text: "What is in this picture?" },
          { type: "image_url", image_url: { url: "data:image/png;base64," + png } },
        ] },
      ],
    });
    check(r.choices.length === 1 && r.choices[0].message.content.length > 0, "a chat answer: " + JSON.stringify(r));
  },

  async "completions-batch"() {
    const r = await gw1.completions.create({ model, prompt: ["Once upon a time", "In a galaxy far away, long ago"], max_tokens: 3 });
    check(r.choices.length === 2, "two choices: " + JSON.stringify(r));
    check(r.choices.map((c) => c.index).sort().join() === "0,1", "choice indexes 0 and 1");
    check(r.usage.completion_tokens === 6, "usage summed: " + JSON.stringify(r.usage));
  },

  async "responses"() {
    // Create (not streamed) on gateway 1.
    const { data: r, response: h } = await gw1.responses
      .create({ model, input: "Tell me about prefix caches.", instructions: "Be brief.", max_output_tokens: 5 })
      .withResponse();
    check(r.id.startsWith("resp_") && r.status === "completed", "a completed response: " + JSON.stringify(r));
    check(r.output_text.length > 0, "output_text");
    const owner = h.headers.get("x-kvmesh-replica");
    check(owner, "the gateway names the replica");

    // Create, streamed, on gateway 2.
    const stream = await gw2.responses.create({ model, input: "And a second one.", max_output_tokens: 4, stream: true });
    let completed = null, deltas = 0;
    for await (const ev of stream) {
      if (ev.type === "response.output_text.delta") deltas++;
      if (ev.type === "response.completed") completed = ev.response;
    }
    check(completed && completed.id.startsWith("resp_") && deltas === 4, `a streamed response (deltas ${deltas})`);

    // A follow-up naming r on the other gateway: it must reach r's replica.
    for (let i = 0; i < 3; i++) {
      const { data: f, response: fh } = await gw2.responses
        .create({ model, input: "Go on.", previous_response_id: r.id, max_output_tokens: 3 })
        .withResponse();
      check(f.previous_response_id === r.id, "the follow-up names its predecessor");
      check(fh.headers.get("x-kvmesh-replica") === owner, `follow-up on ${fh.headers.get("x-kvmesh-replica")}, stored on ${owner}`);
      check(f.usage.input_tokens > r.usage.input_tokens, "the follow-up carries the stored conversation");
    }

    // Retrieve on gateway 2, delete on gateway 1, then it is gone.
    const got = await gw2.responses.retrieve(r.id);
    check(got.id === r.id && got.output_text === r.output_text, "retrieved the stored response");
    const got2 = await gw1.responses.retrieve(completed.id);
    check(got2.id === completed.id, "retrieved the streamed response on the other gateway");
    await gw1.responses.delete(r.id);
    let status = 0;
    try {
      await gw2.responses.retrieve(r.id);
    } catch (e) {
      status = e.status;
    }
    check(status === 404, "a deleted response is 404, got " + status);
  },

  async "embeddings"() {
    const r = await gw1.embeddings.create({ model, input: ["kv cache", "prefix"] });
    check(r.data.length === 2, "two embeddings");
    check(r.data[0].embedding.length === 16 && r.data[0].embedding.every(Number.isFinite), "16 finite floats");
    const norm = Math.hypot(...r.data[0].embedding);
    check(Math.abs(norm - 1) < 1e-4, "a unit vector, norm " + norm);
    const again = await gw2.embeddings.create({ model, input: "kv cache", encoding_format: "float" });
    check(again.data[0].embedding.every((x, i) => Math.abs(x - r.data[0].embedding[i]) < 1e-6), "deterministic across gateways and formats");
  },

  async "transcription"() {
    const file = await toFile(wav(1.5), "speech.wav", { type: "audio/wav" });
    const r = await gw1.audio.transcriptions.create({ model, file });
    check(r.text === "1.50 seconds of audio", "the engine heard the whole file: " + JSON.stringify(r));
  },
};

const name = process.argv[2];
if (!cases[name]) {
  console.error("unknown case " + name + "; cases: " + Object.keys(cases).join(" "));
  process.exit(2);
}
try {
  await cases[name]();
  console.log("ok " + name);
} catch (e) {
  console.error(name + ": " + (e.stack ?? e));
  process.exit(1);
}
