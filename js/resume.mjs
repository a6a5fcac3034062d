// Drives a resumable guarded `useChat` route with the Vercel AI SDK's own chat (`AbstractChat`,
// what `useChat` wraps, on a plain state) and `DefaultChatTransport`:
//
//   node js/resume.mjs <base url> <chat id> [stop]
//
// With `stop`, the chat sends a message and stops (`chat.stop()`, the browser leaving) after
// its first text deltas. Then a new chat of the same id (a page loaded again, holding the
// user's message) calls `resumeStream()`, as `useChat({ resume: true })` does on mount: the
// transport asks `GET <base url>/chat/<chat id>/stream`. Prints one JSON object: `stopped`
// (the text the first chat had when it stopped, or null), `messages` (the resumed chat's),
// `status` and `error` (its error's message, or null).
import { AbstractChat, DefaultChatTransport } from "ai";

const [base, chatId, mode] = process.argv.slice(2);

class State {
  constructor(messages = []) {
    this.messages = messages;
    this.status = "ready";
    this.error = undefined;
    this.changed = () => {};
  }
  pushMessage(message) {
    this.messages = this.messages.concat(message);
    this.changed();
  }
  popMessage() {
    this.messages = this.messages.slice(0, -1);
  }
  replaceMessage(index, message) {
    this.messages = [...this.messages.slice(0, index), message, ...this.messages.slice(index + 1)];
    this.changed();
  }
  snapshot(thing) {
    return structuredClone(thing);
  }
}

class Chat extends AbstractChat {
  constructor(messages) {
    const state = new State(messages);
    super({
      id: chatId,
      state,
      transport: new DefaultChatTransport({ api: `${base}/chat`, headers: { "x-user-id": "sdk" } }),
    });
    this.chatState = state;
  }
}

const text = (message) =>
  message.parts.filter((p) => p.type === "text").map((p) => p.text).join("");
const user = { id: "m1", role: "user", parts: [{ type: "text", text: "Where is my parcel?" }] };
const out = { stopped: null, messages: [], status: null, error: null };

if (mode === "stop") {
  const first = new Chat([]);
  first.chatState.changed = () => {
    const last = first.chatState.messages.at(-1);
    if (last?.role === "assistant" && text(last).length >= 20 && out.stopped === null) {
      out.stopped = text(last);
      first.stop();
    }
  };
  await first.sendMessage(user);
}
const again = new Chat(mode === "stop" ? [user] : []);
await again.resumeStream();
out.messages = again.messages;
out.status = again.status;
out.error = again.error ? String(again.error.message ?? again.error) : null;
process.stdout.write(JSON.stringify(out) + "\n");
