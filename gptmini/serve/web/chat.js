// The page's chat mode: the conversation so far, the body of a /v1/chat/completions call,
// and its stream's chunks turned into the shape the page reads completions in (the
// conversation as the model's chat template renders it is the "prompt": its token ids come
// back with return_token_ids; then the reply's ids and logprobs). So the whole
// conversation, the template's tokens included, is inspected as any text is.

export class Conversation {
  // box: the element the transcript is written in.
  constructor(box) {
    this.box = box;
    this.messages = [];   // the turns so far: {role, content}
    this.pending = null;  // the user's message while its reply streams
    this.reply = "";
    this.replyNode = null;
  }

  reset() {
    this.messages = [];
    this.pending = null;
    this.box.replaceChildren();
  }

  // The call's body: the system prompt, the turns so far and the new message, with the
  // completions form's settings; the reply's logprobs (10 candidates) and ids come back.
  body(system, text, settings) {
    const messages = system ? [{ role: "system", content: system }] : [];
    messages.push(...this.messages, { role: "user", content: text });
    const body = { ...settings, messages, logprobs: true, top_logprobs: 10 };
    delete body.prompt;
    this.pending = text;
    this.reply = "";
    this.show("user", text);
    this.replyNode = this.show("assistant", "");
    return body;
  }

  // A stream chunk's choices, as completions' (prompt_token_ids, token_ids, logprobs).
  choices(chunk) {
    const out = [];
    for (const c of chunk.choices || []) {
      const piece = (c.delta && c.delta.content) || "";
      this.reply += piece;
      this.replyNode.querySelector(".content").textContent = this.reply;
      const lp = c.logprobs && c.logprobs.content;
      out.push({
        token_ids: c.token_ids || [],
        logprobs: lp ? {
          tokens: lp.map((e) => e.token),
          token_logprobs: lp.map((e) => e.logprob),
          top_logprobs: lp.map((e) => Object.fromEntries(e.top_logprobs.map((t) => [t.token, t.logprob]))),
        } : null,
      });
    }
    if (chunk.prompt_token_ids) {
      if (!out.length) out.push({ token_ids: [], logprobs: null });
      out[0].prompt_token_ids = chunk.prompt_token_ids;
    }
    return out;
  }

  // The reply is over: the turn joins the conversation (kept: true), or is taken back.
  finish(kept) {
    if (this.pending === null) return;
    if (kept) {
      this.messages.push({ role: "user", content: this.pending },
                         { role: "assistant", content: this.reply });
    } else {
      this.replyNode.previousSibling.remove();
      this.replyNode.remove();
    }
    this.pending = null;
  }

  show(role, text) {
    const node = document.createElement("div");
    node.className = `turn ${role}`;
    const who = document.createElement("span");
    who.className = "role";
    who.textContent = role;
    const content = document.createElement("span");
    content.className = "content";
    content.textContent = text;
    node.append(who, content);
    this.box.appendChild(node);
    return node;
  }
}
