"""What the deltas topic carries of a reply's pieces: every character, numbered without a
hole unless a piece was lost (then the hole says so)."""

from __future__ import annotations

from turnstile.events.deltas import MAX_DELTA_CHARS, ReplyDelta
from turnstile.streams.file_log import FileLog
from turnstile.streams.reply_deltas import DeltaPublisher


async def test_a_piece_longer_than_a_delta_holds_goes_as_several_in_order(tmp_path) -> None:
    # Given a server that sends its whole answer in one streamed chunk of 2.5 deltas' worth
    log = FileLog(tmp_path)
    publisher = DeltaPublisher(log, log.topics.deltas, lambda: 1_767_225_600_000)
    stream = publisher.open("c1", "t1", "r1", 1, 1)
    text = "".join(chr(ord("a") + n % 26) for n in range(MAX_DELTA_CHARS * 2 + MAX_DELTA_CHARS // 2))
    await stream.delta("Hi. ")
    await stream.delta(text)
    await stream.finish()
    await publisher.aclose()
    # Then a reader joining the deltas in seq order has the whole reply, with no hole
    deltas = [ReplyDelta.model_validate_json(r.value or b"") for r in log.read_all(log.topics.deltas)]
    assert [d.seq for d in deltas] == [0, 1, 2, 3, 4]
    assert "".join(d.text for d in deltas) == "Hi. " + text and deltas[-1].done
