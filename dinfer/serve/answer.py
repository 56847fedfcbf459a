"""What one request's answer says so far, block by block: the text a stream may send now.

An answer is its generated tokens up to the first EOS, at most max_tokens of them, cut before the
first stop string (dinfer.llm.cut_at_stop), decoded as LLM.generate decodes it. Each committed block
adds tokens; the text to send is the new suffix of the decoded text, less what may still change:
the longest tail that begins a stop string (the next block may complete it, and then that text is
not part of the answer) and a trailing U+FFFD (a byte-level tokenizer's incomplete UTF-8
character, completed by the next token). Once the answer is finished (EOS, max_tokens, a stop
string) nothing is held back and nothing more is added.
"""

from typing import List, Optional, Sequence

from ..llm import cut_at_stop


class Answer:
    def __init__(self, tokenizer, eos_id: int, max_tokens: int, stops: Sequence[str]):
        self.tokenizer, self.eos_id, self.max_tokens, self.stops = tokenizer, eos_id, max_tokens, list(stops)
        self.ids: List[int] = []  # the answer's tokens so far
        self.text = ""
        self.sent = 0  # characters of text handed out by delta()
        self.finish_reason: Optional[str] = None  # "stop" (EOS, a stop string), "length" (max_tokens)

    def add(self, tokens: Sequence[int]) -> None:
        """The next committed tokens of the request (a block's, in order)."""
        if self.finish_reason is not None:
            return
        for t in tokens:
            if t == self.eos_id:
                self.finish_reason = "stop"
                break
            self.ids.append(int(t))
            if len(self.ids) == self.max_tokens:
                self.finish_reason = "length"
                break
        self.text = self.tokenizer.decode(self.ids)
        if any(s in self.text for s in self.stops):  # the answer ends before the first one
            self.ids, self.text = cut_at_stop(self.tokenizer, self.ids, self.stops)
            self.finish_reason = "stop"

    def finish(self, tokens: Sequence[int]) -> None:
        """The request's whole generated region (the engine finished it): whatever the blocks did
        not say yet. The answer is finished."""
        if self.finish_reason is None:
            self.add(list(tokens)[len(self.ids) :])
            # no EOS within the region: it held fewer than max_tokens positions (the context's end)
            self.finish_reason = self.finish_reason or "length"

    def delta(self) -> str:
        """The text not handed out yet that can no longer change."""
        end = len(self.text)
        if self.finish_reason is None:
            end -= max(self._stop_prefix(), 1 if self.text.endswith("\ufffd") else 0)
        out = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out

    def _stop_prefix(self) -> int:
        """The length of the longest tail of the text that a stop string begins with."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best
