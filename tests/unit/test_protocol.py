import re

import msgpack
import pytest

from servicebus.errors import ProtocolError
from servicebus.model.packer import pack
from servicebus.model.segments import bodies_of, make_blob
from servicebus.wire import protocol as P
from servicebus.wire.decoding import decode
from servicebus.wire.payload import decode_payload, encode_payload
from servicebus.wire.protocol import Kind
from servicebus.wire.validation import validate_address

LIMIT = 1 << 20
ADDR = "tcp://127.0.0.1:5555"


def roundtrip(frames):
    assert all(isinstance(f, bytes) for f in frames)
    return decode(frames, max_payload=LIMIT)


def env(i=1, size=1, body=None, **kw):
    """A segment of ``size`` messages (ids ``<key>``, ``<key>.1``, ...) as a sender puts it
    in a frame: its key is its first message's id; its body the blob of their payloads
    (``{"n": i}``, ``{"n": i + 1}``, ...), or a blob of the one payload ``body``."""
    key = f"{i:024x}"
    ids = (key, *(f"{key[:-2]}.{n}" for n in range(1, size)))
    blob = make_blob([encode_payload({"n": i + n}) for n in range(size)] if body is None else [body])
    base = dict(id=key, topic="user.signup", sent=1_700_000_000_000 + i, body=blob, ids=ids)
    base.update(kw)
    return P.Envelope(**base)


@pytest.mark.parametrize("kind", [Kind.EVENT, Kind.COMMAND, Kind.REPLY])
def test_every_message_kind_round_trips_with_all_fields(kind):
    msgs = [env(1), env(2, attempt=3, expires=123, correlation_id="c1", headers={"trace": "t"})]
    frame = roundtrip(P.encode_batch(kind, "node1", ADDR, msgs))
    assert frame == P.Batch(kind, "node1", ADDR, tuple(msgs))
    assert decode_payload(bodies_of(frame.messages[1].body)[0]) == {"n": 2}


@pytest.mark.parametrize("compress", [None, "zstd"])
def test_segments_round_trip_with_their_keys_ids_and_blobs_unchanged(compress):
    if compress is not None:
        pytest.importorskip("zstandard", reason="the compression extra is not installed")
    # Segments of one and of several, big enough (with compression) to be compressed.
    msgs = [env(1, size=3), env(5, body=encode_payload("x" * 3000)), env(9, size=40, headers={"h": [1]})]
    frames = P.encode_batch(Kind.EVENT, "node1", ADDR, msgs, 7, compress=compress)
    assert len(frames) == 3 + len(msgs)  # one part per segment's blob
    if compress:
        assert frames[3:] != [m.body for m in msgs] and "z" in msgpack.unpackb(frames[2])
    else:
        assert frames[3:] == [m.body for m in msgs]
    frame = roundtrip(frames)
    assert frame == P.Batch(Kind.EVENT, "node1", ADDR, tuple(msgs), 7)
    assert [(m.id, m.ids) for m in frame.messages] == [(m.id, m.ids) for m in msgs]
    assert [m.body for m in frame.messages] == [m.body for m in msgs]  # the bytes as stored
    assert [decode_payload(b)["n"] for b in bodies_of(frame.messages[2].body)] == list(range(9, 49))


def test_an_sb1_frame_of_an_older_bus_is_refused_as_old_protocol():
    # What servicebus 0.2 sent: one array per message and one body of payloads.
    header = msgpack.packb({"sender": "n", "reply_to": ADDR,
                            "msgs": [["id1", "t", 1, 1, None, None, {}]]})
    assert reason([P.OLD_MAGIC, bytes([Kind.EVENT]), header, msgpack.packb([encode_payload(1)])]) == "old_protocol"
    ack = P.encode_ack(["a"])
    assert reason([P.OLD_MAGIC, *ack[1:]]) == "old_protocol"


def test_control_kinds_round_trip():
    assert roundtrip(P.encode_ack(["a", "b"])) == P.Ack(("a", "b"))
    assert roundtrip(P.encode_nack(["a"], "no handler")) == P.Nack(("a",), "no handler")
    assert roundtrip(P.encode_subscribe("i1", "t.x", ADDR, "n")) == P.Subscribe("i1", "t.x", ADDR, "n")
    assert roundtrip(P.encode_unsubscribe("i2", "t.x", ADDR, "n")) == P.Unsubscribe("i2", "t.x", ADDR, "n")
    assert roundtrip(P.encode_ping("n", "boot")) == P.Ping("n", "boot")
    assert roundtrip(P.encode_pong("n", "boot")) == P.Pong("n", "boot")


def test_a_subscribe_carries_its_start_position_and_a_bad_one_is_refused():
    for start in ("earliest", "t:1700000000000", "0" * 23 + "1"):
        frames = P.encode_subscribe("i1", "t.x", ADDR, "n", start=start)
        assert roundtrip(frames) == P.Subscribe("i1", "t.x", ADDR, "n", start=start)
    for bad in ("latest", "t:", 5, "G" * 24):
        header = msgpack.unpackb(P.encode_subscribe("i1", "t.x", ADDR, "n")[2])
        header["start"] = bad
        frames = P.encode_subscribe("i1", "t.x", ADDR, "n")
        assert reason([*frames[:2], msgpack.packb(header), *frames[3:]]) == "bad_field"


def test_payloads_of_every_msgpack_type_survive_encoding():
    payload = {"d": {"x": [1, 2.5, True, None]}, "s": "é", "b": b"\x00\xff", "i": -(2**63)}
    assert decode_payload(encode_payload(payload)) == payload


def test_unencodable_payload_raises_type_error_naming_the_type():
    with pytest.raises(TypeError, match="set"):
        encode_payload({"x": {1, 2}})
    with pytest.raises(TypeError, match="object"):
        encode_payload(object())


def reason(frames):
    with pytest.raises(ProtocolError) as info:
        decode(frames, max_payload=LIMIT)
    return info.value.reason


def test_malformed_frames_raise_protocol_errors_with_a_reason():
    good = P.encode_batch(Kind.EVENT, "n", ADDR, [env()])
    assert reason(good[:3]) == "bad_frame_count"
    assert reason([*good, good[3]]) == "bad_frame_count"  # a blob more than its segments
    assert reason([b"XX1", *good[1:]]) == "bad_magic"
    assert reason([good[0], b"\x63", *good[2:]]) == "unknown_kind"
    assert reason([good[0], b"", *good[2:]]) == "unknown_kind"
    assert reason([good[0], good[1], b"\xc1\xc1", good[3]]) == "bad_msgpack"
    assert reason([good[0], good[1], msgpack.packb([1]), good[3]]) == "bad_header"
    assert reason([good[0], good[1], msgpack.packb({"sender": "n"}), good[3]]) == "missing_field"
    # A blob of more payloads than its segment has ids: that segment alone, not the frame.
    two = decode([good[0], good[1], good[2], msgpack.packb([b"1", b"2"])], max_payload=LIMIT)
    assert two.messages == () and [m.id for m in two.invalid] == [env().id]
    assert "blob must be an array of 1 payloads" in two.invalid[0].error
    # A payload is not decoded on receipt: one that does not decode travels in its segment
    # (its handler's run makes it a dead letter: test_segment_run.py).
    junk = decode([good[0], good[1], good[2], msgpack.packb([b"\xc1"])], max_payload=LIMIT)
    assert [m.body for m in junk.messages] == [msgpack.packb([b"\xc1"])]
    assert junk.invalid == () and junk.undecodable == ()
    ack = P.encode_ack(["a"])
    assert reason([ack[0], ack[1], ack[2], b"extra"]) == "bad_body"
    assert reason([*ack, b""]) == "bad_frame_count"


def test_fields_of_the_frame_are_validated():
    def batch_with(meta, reply_to=ADDR):
        header = msgpack.packb({"sender": "n", "reply_to": reply_to, "segs": [meta]})
        return [P.MAGIC, bytes([Kind.EVENT]), header, make_blob([encode_payload(1)])]

    ok = ["id1", "t", 1, 1, None, None, {}, ["id1"]]
    assert isinstance(roundtrip(batch_with(ok)), P.Batch)
    assert reason(batch_with(ok, reply_to="tcp://evil")) == "bad_address"
    assert reason(batch_with(ok, reply_to="inproc://x")) == "bad_address"
    # A message's own fields: see "a message whose own fields are not valid" below.


def test_oversize_payloads_are_refused_by_id_and_the_rest_of_the_frame_is_accepted():
    big = env(body=encode_payload(b"x" * 2000))
    small = env(body=encode_payload(b"y"))._replace(id="small-1", ids=("small-1",))
    frame = decode(P.encode_batch(Kind.EVENT, "n", ADDR, [big, small]), max_payload=1000)
    assert frame.oversize == ((big.id, (big.id,)),)  # by id, naming its segment
    assert [m.id for m in frame.messages] == ["small-1"]


def test_a_message_too_large_is_left_out_of_its_segment_which_goes_on_with_the_others():
    bodies = [encode_payload(b"a"), encode_payload(b"x" * 2000), encode_payload(b"c"), encode_payload(b"y" * 3000)]
    seg = P.Envelope("k1", "t", 1, make_blob(bodies), ids=("k1", "k2", "k3", "k4"))
    frame = decode(P.encode_batch(Kind.EVENT, "n", ADDR, [seg]), max_payload=1000)
    assert frame.oversize == (("k1", ("k2", "k4")),)  # NACKed by id, naming their segment
    [kept] = frame.messages
    assert (kept.id, kept.ids) == ("k1", ("k1", "k3"))  # the segment, under its key
    assert bodies_of(kept.body) == [bodies[0], bodies[2]]
    # Every message of a segment too large: nothing of it goes on.
    big = P.Envelope("k2", "t", 1, make_blob([bodies[1], bodies[3]]), ids=("k2", "k4"))
    whole = decode(P.encode_batch(Kind.EVENT, "n", ADDR, [big, seg._replace(id="k5", ids=("k5", "k6", "k7", "k8"))]),
                   max_payload=1000)
    assert whole.oversize == (("k2", ("k2", "k4")), ("k5", ("k6", "k8")))
    assert [m.ids for m in whole.messages] == [("k5", "k7")]


def test_a_pong_carries_the_largest_payload_its_bus_accepts():
    assert decode(P.encode_pong("n", "b", 4096), max_payload=1) == P.Pong("n", "b", 4096)
    assert decode(P.encode_pong("n", "b"), max_payload=1) == P.Pong("n", "b", None)


def test_an_ipc_path_longer_than_a_socket_path_can_be_is_refused():
    validate_address("ipc:///" + "x" * 106)
    with pytest.raises(ValueError, match="at most 107 bytes"):
        validate_address("ipc:///" + "x" * 107)


@pytest.mark.parametrize("address", [
    "tcp://127.0.0.1:1", "tcp://localhost:65535", "tcp://[::1]:80", "ipc:///tmp/x.sock"])
def test_valid_addresses(address):
    assert validate_address(address) == address


@pytest.mark.parametrize("address", [
    "tcp://127.0.0.1", "tcp://127.0.0.1:0", "tcp://127.0.0.1:70000", "tcp://*:5555",
    "tcp://0.0.0.0:5555", "udp://x:1", "inproc://x", "", 5, "tcp://a b:1"])
def test_invalid_addresses(address):
    with pytest.raises(ValueError):
        validate_address(address)


def test_random_junk_never_escapes_as_anything_but_protocol_error():
    import random
    rng = random.Random(7)
    good = P.encode_batch(Kind.EVENT, "n", ADDR, [env(), env(2, size=3)])
    for _ in range(3000):
        frames = [bytearray(f) for f in good]
        part = rng.randrange(len(frames))
        if frames[part]:
            for _ in range(rng.randint(1, 4)):
                frames[part][rng.randrange(len(frames[part]))] = rng.randrange(256)
        try:
            decode([bytes(f) for f in frames], max_payload=LIMIT)
        except ProtocolError:
            pass


# --- compression (issue 14) ------------------------------------------------------------------

zstandard = pytest.importorskip("zstandard", reason="the compression extra is not installed")


def big_batch(n=20, size=2000):
    """``n`` segments of one message each, of a payload of ``size`` bytes."""
    return [P.Envelope(f"id{i}", "t", 1, make_blob([encode_payload("x" * size)]), 1, None, None, {}, (f"id{i}",))
            for i in range(n)]


def test_a_compressed_batch_decodes_to_the_same_messages_and_is_smaller():
    msgs = big_batch()
    plain = P.encode_batch(Kind.EVENT, "s", "tcp://127.0.0.1:1", msgs, 5)
    packed = P.encode_batch(Kind.EVENT, "s", "tcp://127.0.0.1:1", msgs, 5, compress="zstd")
    assert sum(map(len, packed[3:])) < sum(map(len, plain[3:])) / 10
    decoded = decode(packed, max_payload=1 << 20)
    assert decoded == decode(plain, max_payload=1 << 20)
    assert decoded.messages == tuple(m._replace(headers=None) for m in msgs) and decoded.invalid == ()


def test_a_small_batch_is_sent_as_it_is_even_with_compression_on():
    msgs = big_batch(1, 100)
    assert P.encode_batch(Kind.EVENT, "s", "tcp://127.0.0.1:1", msgs, compress="zstd") == \
        P.encode_batch(Kind.EVENT, "s", "tcp://127.0.0.1:1", msgs)


def compressed_frames(body: bytes, codec="zstd", n=1):
    """A frame of one segment of ``n`` messages whose (compressed) blob is ``body``."""
    header = {"sender": "s", "reply_to": "tcp://127.0.0.1:1", "z": codec,
              "segs": [["i0", "t", 1, 1, None, None, {}, [f"i{k}" for k in range(n)]]]}
    return [P.MAGIC, bytes([Kind.EVENT]), msgpack.packb(header), body]


def test_a_frame_declaring_more_than_its_messages_may_hold_is_refused_before_decompressing():
    # Per segment: its blob may hold one segment's worth (protocol.frame_body_limit).
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (64 << 20))  # 64 MiB of zeros, ~2 KiB
    assert len(bomb) < 1 << 16
    with pytest.raises(ProtocolError) as err:
        decode(compressed_frames(bomb), max_payload=1000)
    assert err.value.reason == "bad_compression"
    streamed = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * (8 << 20))
    with pytest.raises(ProtocolError, match="bad_compression|did not|exceed|error"):
        decode(compressed_frames(streamed), max_payload=1000)


@pytest.mark.parametrize("codec, body", [("lz77", b"x"), ("zstd", b"not zstd at all")])
def test_an_unknown_codec_or_a_damaged_body_is_a_protocol_error(codec, body):
    with pytest.raises(ProtocolError) as err:
        decode(compressed_frames(body, codec), max_payload=1000)
    assert err.value.reason == "bad_compression"


def test_a_pong_says_which_codecs_its_bus_decodes():
    pong = decode(P.encode_pong("n", "b", 10, ("zstd",)), max_payload=10)
    assert pong.codecs == ("zstd",)
    assert decode(P.encode_pong("n", "b", 10), max_payload=10).codecs == ()
    header = msgpack.packb({"sender": "n", "boot": "b", "z": "zstd"})
    with pytest.raises(ProtocolError):
        decode([P.MAGIC, bytes([Kind.PONG]), header, b""], max_payload=10)


# --- decompression limits: what one frame may carry, and not a byte more -----------------------


def zstd_frame(data: bytes, *, declared: bool) -> bytes:
    """``data`` zstd-compressed, with its size in the frame or (as a stream) without."""
    return zstandard.ZstdCompressor(level=1, write_content_size=declared).compress(data)


def zeros_without_size(n_mib: int) -> bytes:
    """``n_mib`` MiB of zeros as one zstd frame that does not declare its size (a few KB)."""
    comp = zstandard.ZstdCompressor(level=1, write_content_size=False).compressobj()
    chunk = bytes(1 << 20)
    return b"".join([*(comp.compress(chunk) for _ in range(n_mib)), comp.flush()])


def body_of_exactly(size: int) -> bytes:
    """A well-formed blob of two payloads (each a valid msgpack bin32: ``size`` of at
    least 256 KiB) ``size`` bytes long."""
    first = (size - 11) // 2  # array (1 byte), two bin32 payloads (5 + 5 bytes of headers)
    payloads = [encode_payload(b"y" * (n - 5)) for n in (first, size - 11 - first)]
    body = msgpack.packb(payloads, use_bin_type=True)
    assert len(body) == size
    return body


@pytest.mark.parametrize("declared", [True, False], ids=["size declared", "size not declared"])
def test_a_compressed_frame_is_read_up_to_what_one_frame_may_carry_and_refused_one_byte_past_it(declared):
    cap = P.frame_body_limit(2, LIMIT)
    assert cap < LIMIT + (1 << 16)  # one frame's worth, not one max_payload per message
    at_cap = decode(compressed_frames(zstd_frame(body_of_exactly(cap), declared=declared), n=2),
                      max_payload=LIMIT)
    assert [m.ids for m in at_cap.messages] == [("i0", "i1")] and at_cap.invalid == ()
    with pytest.raises(ProtocolError) as err:
        decode(compressed_frames(zstd_frame(body_of_exactly(cap + 1), declared=declared), n=2),
                 max_payload=LIMIT)
    assert err.value.reason == "bad_compression"


@pytest.mark.parametrize("declared", [True, False], ids=["size declared", "size not declared"])
def test_declaring_thousands_of_messages_does_not_raise_what_a_frame_may_decompress_to(declared):
    body = zstd_frame(bytes(8 << 20), declared=declared)  # 8 MiB: eight frames' worth
    with pytest.raises(ProtocolError) as err:
        decode(compressed_frames(body, n=P.MAX_BATCH), max_payload=LIMIT)
    assert err.value.reason == "bad_compression"


def test_a_bomb_without_a_declared_size_is_refused_while_streaming_never_holding_more_than_the_cap():
    import tracemalloc

    bomb = zeros_without_size(1024)  # 1 GiB of zeros in ~32 KB
    assert len(bomb) < 64 << 10
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError) as err:
            decode(compressed_frames(bomb, n=P.MAX_BATCH), max_payload=LIMIT)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert err.value.reason == "bad_compression"
    assert peak < 2 * P.frame_body_limit(P.MAX_BATCH, LIMIT) + (4 << 20), f"peak {peak >> 20} MiB"


def test_a_frame_that_asks_the_decoder_for_a_huge_window_is_refused():
    # 256 KiB of data, but a stream whose window (the decoder's buffer) is 128 MiB.
    params = zstandard.ZstdCompressionParameters.from_level(1, window_log=27, write_content_size=0)
    comp = zstandard.ZstdCompressor(compression_params=params).compressobj()
    body = comp.compress(body_of_exactly(1 << 18)) + comp.flush()
    assert zstandard.get_frame_parameters(body).window_size == 1 << 27
    with pytest.raises(ProtocolError) as err:
        decode(compressed_frames(body, n=2), max_payload=LIMIT)
    assert err.value.reason == "bad_compression"


def test_frames_compressed_by_a_sender_at_any_level_still_decode():
    msgs = big_batch(n=4, size=200_000)
    plain = P.encode_batch(Kind.EVENT, "s", "tcp://127.0.0.1:1", msgs, 5)
    assert len(decode(plain, max_payload=LIMIT).messages) == 4
    for level in (1, 3, 19):
        blobs = [zstandard.ZstdCompressor(level=level).compress(blob) for blob in plain[3:]]
        header = msgpack.unpackb(plain[2], raw=False)
        header["z"] = "zstd"
        frames = [plain[0], plain[1], msgpack.packb(header, use_bin_type=True), *blobs]
        assert decode(frames, max_payload=LIMIT) == decode(plain, max_payload=LIMIT)


# --- what publish accepts, every receiver decodes (DESIGN rule 11) ------------------------------


def receiver_decodes(value) -> bool:
    """The oracle: msgpack as a publisher packs and as a receiver unpacks (no bus code)."""
    try:
        body = msgpack.packb(value, use_bin_type=True)
    except Exception:  # noqa: BLE001 - cannot even be sent
        return False
    try:
        msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception:  # noqa: BLE001 - sent, and refused by every receiver
        return False
    return True


class Hashable(dict):
    """A dict that can be a key: msgpack packs it as a map, which decodes to a plain dict."""

    def __hash__(self):
        return id(self)


@pytest.mark.parametrize("payload, where", [
    ([0, 1, 2, {"a": {(1, 2): 3}}],
     r'payload\[3\]\["a"\]: map key \(1, 2\) is a tuple; a receiver cannot decode it'),
    ({(): 1}, r"payload: map key \(\) is a tuple; a receiver cannot decode it"),
    ({"k": {((1,), "x"): 1}}, r'payload\["k"\]: map key \(\(1,\), .x.\) is a tuple'),
    ({"k": [{Hashable(a=1): 2}]}, r'payload\["k"\]\[0\]: map key \{.a.: 1\} is a Hashable \(a map\)'),
    ({"x": {1, 2}}, r'payload\["x"\]: a set cannot be encoded with msgpack'),
    ([object()], r"payload\[0\]: an object cannot be encoded with msgpack"),
    ({b"k": [1, 2**64]}, r"payload\[b'k'\]\[1\]: int 18446744073709551616 is out of msgpack's range"),
    ({"s": ["ok", "a\ud800b"]}, r'payload\["s"\]\[1\]: str .* lone surrogate'),
    ({frozenset(): 1}, r"payload: map key frozenset\(\) is a frozenset, which cannot be encoded"),
])
def test_publish_refuses_what_no_receiver_can_decode_saying_where_in_the_payload(payload, where):
    assert not receiver_decodes(payload)
    with pytest.raises(TypeError, match=where):
        encode_payload(payload)


def nested(depth: int, leaf=1):
    value = leaf
    for i in range(depth):
        value = [value] if i % 2 else {"d": value}
    return value


@pytest.mark.parametrize("payload", [
    {None: 1, True: 2, False: 3, 1.5: 4, -7: 5, b"\xff": 6, "": 7},
    {"t": (1, (2, (3,))), "f": [float("nan"), float("inf"), -0.0, 1e308]},
    [2**64 - 1, -(2**63), 0], bytearray(b"\x00\x01"), memoryview(b"abc"),
    {"ext": msgpack.ExtType(5, b"x"), "ts": msgpack.Timestamp(1, 2)},
    nested(500), "é" * 1000, "\U0001f600",
])
def test_publish_accepts_odd_but_decodable_payloads_and_a_receiver_reads_them_back(payload):
    body = encode_payload(payload)
    assert pack(decode_payload(body)) == body  # what was sent, read back the same


def odd_values(rng, depth=0):
    """A random value of the kinds users put in payloads, and of kinds they should not:
    hypothesis-style, from a seeded generator (no extra dependency)."""
    scalars = [
        lambda: None, lambda: rng.random() < 0.5, lambda: rng.randint(-2**70, 2**70) >> rng.choice([0, 60]),
        lambda: rng.choice([2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 0, -1]),
        lambda: rng.choice([0.0, -0.0, 1.5, float("inf"), 1e-310]),
        lambda: float("nan"),
        lambda: "".join(chr(rng.choice([0x61, 0xE9, 0x1F600, 0xD800, 0xDFFF, 0]))
                        for _ in range(rng.randint(0, 4))),
        lambda: bytes(rng.randrange(256) for _ in range(rng.randint(0, 4))),
        lambda: object(), lambda: {1, 2},
        lambda: msgpack.ExtType(rng.randrange(128), b"\x00" * rng.choice([0, 3, 8])),
    ]
    # Keys: the hashable ones (a path cannot be followed through a nan key: nan != nan).
    keys = [make for i, make in enumerate(scalars) if i not in (5, 9)] + [
        lambda: tuple(odd_values(rng, 9) for _ in range(rng.randint(0, 2))),
        lambda: frozenset(), lambda: Hashable(a=1)]
    if depth > 5 or rng.random() < 0.4:
        return rng.choice(scalars)()
    kind = rng.randrange(3)
    if kind == 0:
        return [odd_values(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if kind == 1:
        return tuple(odd_values(rng, depth + 1) for _ in range(rng.randint(0, 3)))
    out = {}
    for _ in range(rng.randint(0, 4)):
        key = rng.choice(keys)()
        try:
            out[key] = odd_values(rng, depth + 1)
        except TypeError:  # an unhashable key: not a payload anyone can build
            pass
    return out


def test_fuzzed_payloads_are_accepted_exactly_when_a_receiver_decodes_them_and_refusals_say_where():
    import random

    rng = random.Random(20)
    accepted = refused = 0
    for _ in range(20_000):
        value = odd_values(rng)
        if receiver_decodes(value):
            body = encode_payload(value)
            assert pack(decode_payload(body)) == body
            accepted += 1
        else:
            with pytest.raises(TypeError) as err:
                encode_payload(value)
            where = str(err.value).split(": ", 1)[0]
            assert where.startswith("payload"), err.value
            # The path names a place that exists in the value (eval'ed: keys print as literals).
            eval(where, {"payload": value, "inf": float("inf"), "ExtType": msgpack.ExtType})  # noqa: S307
            refused += 1
    assert accepted > 3000 and refused > 3000, (accepted, refused)


def test_headers_are_refused_unless_a_receiver_reads_them_with_its_stricter_rules():
    from servicebus.model.outgoing import check_ttl_headers

    check_ttl_headers(None, {"a": {"b": [1, (2, 3)]}, "c": {b"k": None}})
    with pytest.raises(TypeError, match=r'headers\["a"\]: map key 1 is an int; a receiver reads '
                                        r'header maps with str or bytes keys only'):
        check_ttl_headers(None, {"a": {1: 2}})
    with pytest.raises(TypeError, match=r'headers\["a"\]\[0\]: map key \(1, 2\) is a tuple'):
        check_ttl_headers(None, {"a": [{(1, 2): 3}]})


def test_a_ttl_is_refused_at_publish_unless_every_receiver_can_keep_its_end():
    # A receiver takes expires up to the year 9999 (a datetime shows no more): what publish
    # accepts, it must accept (DESIGN rule 11). An endless ttl raised OverflowError.
    from servicebus.model.outgoing import prepare_command, prepare_event

    prepare_event("t", [1], max_payload=LIMIT, ttl=100 * 365 * 86400.0)
    for ttl in (float("inf"), float("nan"), 1e13):
        with pytest.raises(ValueError, match="ttl must be a positive number of seconds"):
            prepare_event("t", [1], max_payload=LIMIT, ttl=ttl)
        with pytest.raises(ValueError, match="ttl must be a positive number of seconds"):
            prepare_command(ADDR, "c", 1, max_payload=LIMIT, ttl=ttl)
    with pytest.raises(ValueError, match="ttl .* ends after the year 9999"):
        prepare_event("t", [1], max_payload=LIMIT, ttl=2 * 365 * 86400.0, deliver_at=253402000000)


# --- a payload no receiver can decode: not decoded on receipt any more --------------------------
# (SB2 carries payloads as the publisher stored them. What does not decode is a dead letter
# for that message alone when its handler's run would get it: test_segment_run.py.)


def test_a_payload_that_does_not_decode_travels_in_its_segment_as_it_came():
    bad = [encode_payload(1)[:0] + b"\x81\x92\x01\x02\x03",  # {[1, 2]: 3}: an unhashable key
           b"\xc1", encode_payload("x")[:-1] + b"\xd4", b"\x01\x02"]  # junk, cut short, extra data
    msgs = [env(0)] + [env(i + 1, body=body) for i, body in enumerate(bad)] + [env(9)]
    msgs.append(P.Envelope("seg", "user.signup", 1, make_blob([encode_payload(0), bad[0], encode_payload(2)]),
                           ids=("seg", "seg.1", "seg.2")))
    frame = roundtrip(P.encode_batch(Kind.EVENT, "n", ADDR, msgs))
    assert frame.messages == tuple(msgs)  # every segment, its blob's bytes as they came
    assert frame.undecodable == () and frame.invalid == ()


def test_a_blob_holding_more_payloads_than_its_segment_has_ids_is_set_apart_before_they_are_built():
    import tracemalloc

    header = msgpack.packb({"sender": "s", "reply_to": ADDR, "segs": [["i", "t", 1, 1, None, None, {}, ["i"]]]})
    body = msgpack.packb([b"ab"] * 1_000_000)  # 4 MB: a million payloads, ~45 MB as objects
    tracemalloc.start()
    try:
        frame = decode([P.MAGIC, bytes([Kind.EVENT]), header, body], max_payload=LIMIT)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # That segment alone: one dead letter under its key, its blob as it came.
    assert frame.messages == () and [(m.id, m.ids) for m in frame.invalid] == [("i", ("i",))]
    assert "blob must be an array of 1 payloads" in frame.invalid[0].error
    assert frame.invalid[0].body is body
    assert peak < 1 << 20, f"peak {peak >> 20} MiB"


# --- a segment whose own fields are not valid: a dead letter for that segment alone ------------
# (DESIGN rule 11: an older or hostile sender's one bad segment must not refuse its frame, or
# the frame is resent for ever, its other segments never arrive and an ordered lane stops.)

YEAR_10000 = 253_402_300_800_000  # ms: what a datetime (Message.sent, .expires) cannot show


def meta(key, **fields):
    """A segment's header array as a sender puts it in a frame, fields by name (``ids``: its
    key alone unless given)."""
    base = dict(id=key, topic="user.signup", sent=1_700_000_000_000, attempt=1, expires=None,
                correlation_id=None, headers={}, ids=[key])
    base.update(fields)
    return list(base.values())


def batch_of(*metas, bodies=None, kind=Kind.EVENT, **header):
    """A batch frame's parts, as a sender that did not check what it sent would make them:
    each segment's blob holds payload ``n`` for the n-th segment (one payload per id)."""
    head = {"sender": "n", "reply_to": ADDR, "segs": list(metas), **header}
    if bodies is None:
        bodies = [make_blob([encode_payload(n)] * (len(m[7]) if isinstance(m, list) and len(m) == 8
                                                    and isinstance(m[7], list) and m[7] else 1))
                  for n, m in enumerate(metas)]
    return [P.MAGIC, bytes([kind]), msgpack.packb(head), *bodies]


@pytest.mark.parametrize("field, value, why", [
    ("topic", "a b", r"topic 'a b' contains a whitespace"),
    ("topic", "", "topic must not be empty"),
    ("topic", "t" * 256, "topic is 256 bytes long"),
    ("topic", "t\x7f", "control character"),
    ("topic", "orders.*", "reserved for subscription patterns"),
    ("topic", ["t"], "topic must be a str, not list"),
    ("topic", None, "topic must be a str, not NoneType"),
    ("sent", -1, "sent must be an int"),
    ("sent", "1", "sent must be an int"),
    ("sent", 1.5, "sent must be an int"),
    ("sent", True, "sent must be an int"),
    ("sent", YEAR_10000, "sent must be an int"),
    ("attempt", 0, "attempt must be an int"),
    ("attempt", 2**31, "attempt must be an int"),
    ("expires", "x", "expires must be an int"),
    ("expires", 2**64 - 1, "expires must be an int"),
    ("correlation_id", 5, "correlation_id must be a non-empty str"),
    ("correlation_id", "", "correlation_id must be a non-empty str"),
    ("correlation_id", "c" * 65, "correlation_id must be a non-empty str of at most 64"),
    ("headers", [], "headers must be a map, not list"),
    ("headers", "x", "headers must be a map, not str"),
    ("ids", [], "ids must be a non-empty list of message ids"),
    ("ids", "id-bad", "ids must be a non-empty list of message ids"),
    ("ids", ["id-bad", 5], "ids must be a non-empty list of message ids"),
    ("ids", ["id-bad", ""], "ids must be a non-empty list of message ids"),
    ("ids", ["id-bad", "i" * 65], "ids must be a non-empty list of message ids"),
])
def test_a_message_with_a_bad_field_is_set_apart_naming_it_and_the_rest_of_its_frame_decodes(
        field, value, why):
    bad = meta("id-bad", **{field: value})
    frames = batch_of(meta("id-0"), bad, meta("id-2"))
    frame = roundtrip(frames)
    assert [m.id for m in frame.messages] == ["id-0", "id-2"]
    [invalid] = frame.invalid
    assert invalid.id == "id-bad"
    assert invalid.error.startswith(field) and re.search(why, invalid.error), invalid.error
    # What it was, kept as it came: its header array and its blob's bytes.
    assert msgpack.unpackb(invalid.header, raw=False) == bad
    assert invalid.body == frames[4]
    shown = "user.signup" if field != "topic" else value if isinstance(value, str) else None
    assert invalid.topic == shown
    # Its messages, where its ids are not what is wrong (else its key stands for them).
    assert invalid.message_ids() == (("id-bad",) if field != "ids" else (invalid.ids or ("id-bad",)))
    if field == "ids":
        assert invalid.ids == ()  # they cannot be named


def test_a_segment_of_several_with_a_bad_field_is_set_apart_whole_naming_its_messages():
    bad = meta("s1", ids=["s1", "s2", "s3"], attempt=0)
    frame = roundtrip(batch_of(meta("id-0"), bad, meta("id-2")))
    assert [m.id for m in frame.messages] == ["id-0", "id-2"]
    [invalid] = frame.invalid
    assert (invalid.id, invalid.ids) == ("s1", ("s1", "s2", "s3"))
    assert invalid.body == make_blob([encode_payload(1)] * 3)


@pytest.mark.parametrize("kind", [Kind.COMMAND, Kind.REPLY])
def test_a_command_or_reply_segment_of_several_messages_is_set_apart(kind):
    # A command and a reply travel alone: each is a segment of one (its correlation id,
    # its reply, its dead letter are the one message's).
    bad = meta("c1", ids=["c1", "c2"], correlation_id="corr")
    frame = roundtrip(batch_of(meta("c0", correlation_id="corr"), bad, kind=kind))
    assert [(m.id, m.ids) for m in frame.messages] == [("c0", ("c0",))]
    [invalid] = frame.invalid
    assert (invalid.id, invalid.ids) == ("c1", ("c1", "c2"))
    assert re.search("travels alone", invalid.error), invalid.error


@pytest.mark.parametrize("bad, blob, why", [
    (meta("id-bad")[:7], make_blob([encode_payload(1)]), r"7 fields; expected 8"),
    (meta("id-bad") + ["more"], make_blob([encode_payload(1)]), r"9 fields; expected 8"),
    (meta("id-bad"), msgpack.packb([7]), r"blob must be an array of 1 payloads"),
    (meta("id-bad"), msgpack.packb([None]), r"blob must be an array of 1 payloads"),
    (meta("id-bad"), msgpack.packb([[1]]), r"blob must be an array of 1 payloads"),
    (meta("id-bad"), msgpack.packb([[1, 2]]), r"blob must be an array of 1 payloads"),
    (meta("id-bad"), msgpack.packb(7), r"blob must be an array of 1 payloads"),  # not an array
    (meta("id-bad"), b"\xc1", r"blob must be an array of 1 payloads"),  # not msgpack
    (meta("id-bad"), make_blob([encode_payload(1)]) + b"\x01", r"blob must be an array of 1 payloads"),
    (meta("id-bad"), make_blob([]), r"blob must be an array of 1 payloads"),  # fewer than its ids
    (meta("id-bad", ids=["id-bad", "id-b2"]), make_blob([encode_payload(1)] * 3), r"array of 2 payloads"),
    (meta("id-bad"), msgpack.packb(["a str"]), r"blob must be an array of 1 payloads"),
    (meta("id-bad"), msgpack.packb([{"a": 1}]), r"blob must be an array of 1 payloads"),
])
def test_a_message_of_the_wrong_shape_whose_id_can_be_read_is_set_apart_too(bad, blob, why):
    frame = roundtrip(batch_of(meta("id-0"), bad, bodies=[make_blob([encode_payload(0)]), blob]))
    assert [m.id for m in frame.messages] == ["id-0"]
    [invalid] = frame.invalid
    assert invalid.id == "id-bad" and re.search(why, invalid.error), invalid.error
    assert msgpack.unpackb(invalid.header, raw=False) == bad
    assert invalid.body == blob
    assert invalid.message_ids() == tuple(bad[7]) if len(bad) > 7 else ("id-bad",)


NOT_UTF8 = b"\xa4\xff\xfe\xfd\xfc"  # a msgpack str of 4 bytes that are not UTF-8


@pytest.mark.parametrize("field, value, why", [
    ("headers", {"a": {1: 2}}, r"headers: .*int is not allowed for map key"),
    ("headers", {1: "x"}, r"headers: .*int is not allowed for map key"),
    ("headers", {"a": [{(1, 2): 3}]}, r"headers: .*list is not allowed for map key"),
    ("headers", {"sb-order": "s1", "z": {None: 1}}, r"headers: .*NoneType is not allowed for map key"),
    ("topic", {1: 2}, r"topic: .*int is not allowed for map key"),
    ("correlation_id", "PLACEHOLDER", r"correlation_id: .*UnicodeDecodeError"),
    ("headers", {"k": "PLACEHOLDER"}, r"headers: .*UnicodeDecodeError"),
    ("ids", ["id-bad", "PLACEHOLDER"], r"ids: .*UnicodeDecodeError"),
])
def test_a_message_whose_header_a_receiver_cannot_read_is_set_apart_and_the_rest_of_its_frame_decodes(
        field, value, why):
    # Header maps are read with str or bytes keys only, and str as UTF-8: msgpack refuses
    # the rest as it reads them, so the frame's header does not decode as a whole.
    bad = meta("id-bad", **{field: value})
    frames = batch_of(meta("id-0", headers={"sb-order": "s1"}), bad, meta("id-2"),
                      bodies=[make_blob([encode_payload(n)]) for n in range(3)])
    frames[2] = frames[2].replace(msgpack.packb("PLACEHOLDER"), NOT_UTF8)
    frame = roundtrip(frames)
    assert [m.id for m in frame.messages] == ["id-0", "id-2"]
    assert frame.messages[0].headers == {"sb-order": "s1"}
    [invalid] = frame.invalid
    assert invalid.id == "id-bad" and re.search(why, invalid.error), invalid.error
    assert invalid.header in frames[2]  # its bytes, exactly as they came
    assert invalid.body == make_blob([encode_payload(1)])


@pytest.mark.parametrize("bad", [
    meta("", topic="a b"),
    meta(5),
    meta(None),
    meta("i" * 65),
    meta({1: 2}),  # a key a receiver cannot read
    meta("PLACEHOLDER"),  # nor this one (not UTF-8)
    [],
    "id-bad",
    {"id": "id-bad"},
    {1: "id-bad"},
])
def test_a_message_whose_id_cannot_be_used_still_refuses_its_frame(bad):
    # Nothing can ack it or keep it by its key: the frame is counted as malformed, as before.
    frames = batch_of(meta("id-0"), bad, meta("id-2"), bodies=[make_blob([encode_payload(n)]) for n in range(3)])
    frames[2] = frames[2].replace(msgpack.packb("PLACEHOLDER"), NOT_UTF8)
    assert reason(frames) == "bad_id"


def test_what_belongs_to_the_frame_still_refuses_the_frame():
    ok = meta("id-0")
    assert reason(batch_of(ok, sender={1: 2})) == "bad_msgpack"  # unreadable outside a segment
    assert reason(batch_of(ok, **{"now": 2**64 - 1})) == "bad_field"
    assert reason(batch_of(ok, **{"now": YEAR_10000})) == "bad_field"
    frames = batch_of(ok, meta("id-1", headers={"a": {1: 2}}))
    assert reason([*frames[:2], frames[2] + b"\x01", *frames[3:]]) == "bad_msgpack"  # extra data
    assert reason([*frames[:2], frames[2][:-3], *frames[3:]]) == "bad_msgpack"  # cut short
    head = msgpack.packb({"sender": "n", "reply_to": ADDR, "segs": [ok], 7: "x"})
    assert reason([P.MAGIC, bytes([Kind.EVENT]), head, make_blob([b"\x01"])]) == "bad_msgpack"
    assert reason(batch_of(bodies=[make_blob([])])) == "bad_field"  # no segments
    assert reason(batch_of(ok, bodies=[make_blob([b"\x01"]), make_blob([b"\x02"])])) == "bad_frame_count"  # counts differ
    assert reason(batch_of(ok, meta("id-1"), bodies=[make_blob([b"\x01"])])) == "bad_frame_count"


def test_a_frame_of_more_segments_or_messages_than_a_receiver_takes_is_refused():
    # Per frame: MAX_SEGMENTS segments and MAX_BATCH messages in all, at most.
    many = [meta(f"k{n}") for n in range(P.MAX_SEGMENTS + 1)]
    assert reason(batch_of(*many)) == "oversize"
    assert isinstance(roundtrip(batch_of(*many[:P.MAX_SEGMENTS])), P.Batch)
    half = P.MAX_BATCH // 2
    big = [meta(f"s{n}", ids=[f"s{n}.{i}" for i in range(half)]) for n in range(2)]
    assert len(roundtrip(batch_of(*big)).messages) == 2
    big.append(meta("s9"))
    assert reason(batch_of(*big)) == "oversize"


def test_a_frame_with_no_bad_message_decodes_as_before():
    msgs = [env(1, headers={"sb-order": "s1", "trace": {"a": b"x"}}), env(2, expires=YEAR_10000 - 1),
            env(3, size=5)]
    frame = roundtrip(P.encode_batch(Kind.EVENT, "n", ADDR, msgs, sent_at=YEAR_10000 - 1))
    assert frame.messages == tuple(msgs) and frame.invalid == () and frame.undecodable == ()


def test_random_junk_in_a_batch_header_sets_apart_what_it_can_and_never_escapes():
    import random
    rng = random.Random(11)
    msgs = [env(i * 10, size=1 + i % 3, headers={"sb-order": "s1", "k": {"a": [i]}}, correlation_id=f"c{i}")
            for i in range(5)]
    good = P.encode_batch(Kind.EVENT, "n", ADDR, msgs)
    apart = 0
    for _ in range(3000):
        header = bytearray(good[2])
        for _ in range(rng.randint(1, 3)):
            header[rng.randrange(len(header))] = rng.randrange(256)
        try:
            frame = decode([good[0], good[1], bytes(header), *good[3:]], max_payload=LIMIT)
        except ProtocolError:
            continue
        # Every segment is accounted for, once: handed on or set apart, each by a usable key.
        keys = [m.id for m in frame.messages] + [m.id for m in frame.invalid]
        assert len(keys) == 5 and all(type(k) is str and 0 < len(k) <= 64 for k in keys)
        assert frame.oversize == ()  # no payload is large: junk in a header makes none
        for m in frame.messages:  # one handed on has one payload per id
            assert len(bodies_of(m.body)) == len(m.ids) >= 1
        apart += len(frame.invalid)
    assert apart > 100  # most junk lands in one segment's fields
