import re

import msgpack
import pytest

from servicebus.errors import ProtocolError
from servicebus.model.packer import pack
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


def env(i=1, **kw):
    base = dict(id=f"{i:024x}", topic="user.signup", sent=1_700_000_000_000 + i,
                body=encode_payload({"n": i}))
    base.update(kw)
    return P.Envelope(**base)


@pytest.mark.parametrize("kind", [Kind.EVENT, Kind.COMMAND, Kind.REPLY])
def test_every_message_kind_round_trips_with_all_fields(kind):
    msgs = [env(1), env(2, attempt=3, expires=123, correlation_id="c1", headers={"trace": "t"})]
    frame = roundtrip(P.encode_batch(kind, "node1", ADDR, msgs))
    assert frame == P.Batch(kind, "node1", ADDR, tuple(msgs))
    assert decode_payload(frame.messages[1].body) == {"n": 2}


def test_control_kinds_round_trip():
    assert roundtrip(P.encode_ack(["a", "b"])) == P.Ack(("a", "b"))
    assert roundtrip(P.encode_nack(["a"], "no handler")) == P.Nack(("a",), "no handler")
    assert roundtrip(P.encode_subscribe("i1", "t.x", ADDR, "n")) == P.Subscribe("i1", "t.x", ADDR, "n")
    assert roundtrip(P.encode_unsubscribe("i2", "t.x", ADDR, "n")) == P.Unsubscribe("i2", "t.x", ADDR, "n")
    assert roundtrip(P.encode_ping("n", "boot")) == P.Ping("n", "boot")
    assert roundtrip(P.encode_pong("n", "boot")) == P.Pong("n", "boot")


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
    assert reason([b"XX1", *good[1:]]) == "bad_magic"
    assert reason([good[0], b"\x63", *good[2:]]) == "unknown_kind"
    assert reason([good[0], b"", *good[2:]]) == "unknown_kind"
    assert reason([good[0], good[1], b"\xc1\xc1", good[3]]) == "bad_msgpack"
    assert reason([good[0], good[1], msgpack.packb([1]), good[3]]) == "bad_header"
    assert reason([good[0], good[1], msgpack.packb({"sender": "n"}), good[3]]) == "missing_field"
    assert reason([good[0], good[1], good[2], msgpack.packb([b"1", b"2"])]) == "bad_body"
    junk = decode([good[0], good[1], good[2], msgpack.packb([b"\xc1"])], max_payload=LIMIT)
    assert junk.messages == () and len(junk.undecodable) == 1  # that message alone, not the frame
    ack = P.encode_ack(["a"])
    assert reason([ack[0], ack[1], ack[2], b"extra"]) == "bad_body"


def test_fields_of_the_frame_are_validated():
    def batch_with(meta, reply_to=ADDR):
        header = msgpack.packb({"sender": "n", "reply_to": reply_to, "msgs": [meta]})
        return [P.MAGIC, bytes([Kind.EVENT]), header, msgpack.packb([encode_payload(1)])]

    ok = ["id1", "t", 1, 1, None, None, {}]
    assert isinstance(roundtrip(batch_with(ok)), P.Batch)
    assert reason(batch_with(ok, reply_to="tcp://evil")) == "bad_address"
    assert reason(batch_with(ok, reply_to="inproc://x")) == "bad_address"
    # A message's own fields: see "a message whose own fields are not valid" below.


def test_oversize_payloads_are_refused_by_id_and_the_rest_of_the_frame_is_accepted():
    big = env(body=encode_payload(b"x" * 2000))
    small = env(body=encode_payload(b"y"))._replace(id="small-1")
    frame = decode(P.encode_batch(Kind.EVENT, "n", ADDR, [big, small]), max_payload=1000)
    assert frame.oversize == (big.id,)
    assert [m.id for m in frame.messages] == ["small-1"]


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
    good = P.encode_batch(Kind.EVENT, "n", ADDR, [env(), env(2)])
    for _ in range(3000):
        frames = [bytearray(f) for f in good]
        part = rng.randrange(4)
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
    return [P.Envelope(f"id{i}", "t", 1, encode_payload("x" * size), 1, None, None, {}) for i in range(n)]


def test_a_compressed_batch_decodes_to_the_same_messages_and_is_smaller():
    msgs = big_batch()
    plain = P.encode_batch(Kind.EVENT, "s", "tcp://127.0.0.1:1", msgs, 5)
    packed = P.encode_batch(Kind.EVENT, "s", "tcp://127.0.0.1:1", msgs, 5, compress="zstd")
    assert len(packed[3]) < len(plain[3]) / 10
    assert decode(packed, max_payload=1 << 20) == decode(plain, max_payload=1 << 20)


def test_a_small_batch_is_sent_as_it_is_even_with_compression_on():
    msgs = big_batch(1, 100)
    assert P.encode_batch(Kind.EVENT, "s", "tcp://127.0.0.1:1", msgs, compress="zstd") == \
        P.encode_batch(Kind.EVENT, "s", "tcp://127.0.0.1:1", msgs)


def compressed_frames(body: bytes, codec="zstd", n=1):
    header = {"sender": "s", "reply_to": "tcp://127.0.0.1:1", "z": codec,
              "msgs": [[f"i{k}", "t", 1, 1, None, None, {}] for k in range(n)]}
    return [P.MAGIC, bytes([Kind.EVENT]), msgpack.packb(header), body]


def test_a_frame_declaring_more_than_its_messages_may_hold_is_refused_before_decompressing():
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
    """A well-formed batch body of two payloads (each a valid msgpack bin32: ``size`` of at
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
    assert len(at_cap.messages) == 2
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
    for level in (1, 3, 19):
        body = zstandard.ZstdCompressor(level=level).compress(plain[3])
        header = msgpack.unpackb(plain[2], raw=False)
        header["z"] = "zstd"
        frames = [plain[0], plain[1], msgpack.packb(header, use_bin_type=True), body]
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


# --- a message no receiver can decode: a dead letter for that message alone --------------------


def test_an_undecodable_payload_is_set_apart_and_the_rest_of_its_frame_decodes():
    bad = [encode_payload(1)[:0] + b"\x81\x92\x01\x02\x03",  # {[1, 2]: 3}: an unhashable key
           b"\xc1", encode_payload("x")[:-1] + b"\xd4", b"\x01\x02"]  # junk, cut short, extra data
    msgs = [env(0)] + [env(i + 1, body=body) for i, body in enumerate(bad)] + [env(9)]
    frame = roundtrip(P.encode_batch(Kind.EVENT, "n", ADDR, msgs))
    assert [m.id for m in frame.messages] == [msgs[0].id, msgs[-1].id]
    assert [(e, type(why)) for e, why in frame.undecodable] == [(m, str) for m in msgs[1:-1]]
    assert "unhashable" in frame.undecodable[0][1]


def test_a_body_holding_more_payloads_than_its_header_declares_is_refused_before_they_are_built():
    import tracemalloc

    header = msgpack.packb({"sender": "s", "reply_to": ADDR, "msgs": [["i", "t", 1, 1, None, None, {}]]})
    body = msgpack.packb([b"ab"] * 1_000_000)  # 4 MB: a million payloads, ~45 MB as objects
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError) as err:
            decode([P.MAGIC, bytes([Kind.EVENT]), header, body], max_payload=LIMIT)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert err.value.reason == "bad_body"
    assert peak < 1 << 20, f"peak {peak >> 20} MiB"


# --- a message whose own fields are not valid: a dead letter for that message alone -----------
# (DESIGN rule 11: an older or hostile sender's one bad message must not refuse its frame, or
# the frame is resent for ever, its other messages never arrive and an ordered lane stops.)

YEAR_10000 = 253_402_300_800_000  # ms: what a datetime (Message.sent, .expires) cannot show


def meta(mid, **fields):
    """A message's header array as a sender puts it in a frame, fields by name."""
    base = dict(id=mid, topic="user.signup", sent=1_700_000_000_000, attempt=1, expires=None,
                correlation_id=None, headers={})
    base.update(fields)
    return list(base.values())


def batch_of(*metas, bodies=None, **header):
    """A batch frame's parts, as a sender that did not check what it sent would make them."""
    head = {"sender": "n", "reply_to": ADDR, "msgs": list(metas), **header}
    bodies = [encode_payload(i) for i in range(len(metas))] if bodies is None else bodies
    return [P.MAGIC, bytes([Kind.EVENT]), msgpack.packb(head), msgpack.packb(bodies)]


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
])
def test_a_message_with_a_bad_field_is_set_apart_naming_it_and_the_rest_of_its_frame_decodes(
        field, value, why):
    bad = meta("id-bad", **{field: value})
    frame = roundtrip(batch_of(meta("id-0"), bad, meta("id-2")))
    assert [m.id for m in frame.messages] == ["id-0", "id-2"]
    [invalid] = frame.invalid
    assert invalid.id == "id-bad"
    assert invalid.error.startswith(field) and re.search(why, invalid.error), invalid.error
    # What it was, kept as it came: its header array and its payload's bytes.
    assert msgpack.unpackb(invalid.header, raw=False) == bad
    assert invalid.body == encode_payload(1)
    shown = "user.signup" if field != "topic" else value if isinstance(value, str) else None
    assert invalid.topic == shown


@pytest.mark.parametrize("bad, body, why", [
    (meta("id-bad")[:6], encode_payload(1), r"6 fields; expected 7"),
    (meta("id-bad") + ["more"], encode_payload(1), r"8 fields; expected 7"),
    (meta("id-bad"), 7, r"payload must be msgpack bin, not int"),
    (meta("id-bad"), [1, 2], r"payload must be msgpack bin, not list"),
])
def test_a_message_of_the_wrong_shape_whose_id_can_be_read_is_set_apart_too(bad, body, why):
    frame = roundtrip(batch_of(meta("id-0"), bad, bodies=[encode_payload(0), body]))
    assert [m.id for m in frame.messages] == ["id-0"]
    [invalid] = frame.invalid
    assert invalid.id == "id-bad" and re.search(why, invalid.error), invalid.error
    assert msgpack.unpackb(invalid.header, raw=False) == bad
    assert invalid.body == (body if isinstance(body, bytes) else msgpack.packb(body))


NOT_UTF8 = b"\xa4\xff\xfe\xfd\xfc"  # a msgpack str of 4 bytes that are not UTF-8


@pytest.mark.parametrize("field, value, why", [
    ("headers", {"a": {1: 2}}, r"headers: .*int is not allowed for map key"),
    ("headers", {1: "x"}, r"headers: .*int is not allowed for map key"),
    ("headers", {"a": [{(1, 2): 3}]}, r"headers: .*list is not allowed for map key"),
    ("headers", {"sb-order": "s1", "z": {None: 1}}, r"headers: .*NoneType is not allowed for map key"),
    ("topic", {1: 2}, r"topic: .*int is not allowed for map key"),
    ("correlation_id", "PLACEHOLDER", r"correlation_id: .*UnicodeDecodeError"),
    ("headers", {"k": "PLACEHOLDER"}, r"headers: .*UnicodeDecodeError"),
])
def test_a_message_whose_header_a_receiver_cannot_read_is_set_apart_and_the_rest_of_its_frame_decodes(
        field, value, why):
    # Header maps are read with str or bytes keys only, and str as UTF-8: msgpack refuses
    # the rest as it reads them, so the frame's header does not decode as a whole.
    bad = meta("id-bad", **{field: value})
    frames = batch_of(meta("id-0", headers={"sb-order": "s1"}), bad, meta("id-2"))
    frames[2] = frames[2].replace(msgpack.packb("PLACEHOLDER"), NOT_UTF8)
    frame = roundtrip(frames)
    assert [m.id for m in frame.messages] == ["id-0", "id-2"]
    assert frame.messages[0].headers == {"sb-order": "s1"}
    [invalid] = frame.invalid
    assert invalid.id == "id-bad" and re.search(why, invalid.error), invalid.error
    assert invalid.header in frames[2]  # its bytes, exactly as they came
    assert invalid.body == encode_payload(1)


@pytest.mark.parametrize("bad", [
    meta("", topic="a b"),
    meta(5),
    meta(None),
    meta("i" * 65),
    meta({1: 2}),  # an id a receiver cannot read
    meta("PLACEHOLDER"),  # nor this one (not UTF-8)
    [],
    "id-bad",
    {"id": "id-bad"},
    {1: "id-bad"},
])
def test_a_message_whose_id_cannot_be_used_still_refuses_its_frame(bad):
    # Nothing can ack it or keep it by its id: the frame is counted as malformed, as before.
    frames = batch_of(meta("id-0"), bad, meta("id-2"))
    frames[2] = frames[2].replace(msgpack.packb("PLACEHOLDER"), NOT_UTF8)
    assert reason(frames) == "bad_id"


def test_what_belongs_to_the_frame_still_refuses_the_frame():
    ok = meta("id-0")
    assert reason(batch_of(ok, sender={1: 2})) == "bad_msgpack"  # unreadable outside a message
    assert reason(batch_of(ok, **{"now": 2**64 - 1})) == "bad_field"
    assert reason(batch_of(ok, **{"now": YEAR_10000})) == "bad_field"
    frames = batch_of(ok, meta("id-1", headers={"a": {1: 2}}))
    assert reason([*frames[:2], frames[2] + b"\x01", frames[3]]) == "bad_msgpack"  # extra data
    assert reason([*frames[:2], frames[2][:-3], frames[3]]) == "bad_msgpack"  # cut short
    head = msgpack.packb({"sender": "n", "reply_to": ADDR, "msgs": [ok], 7: "x"})
    assert reason([P.MAGIC, bytes([Kind.EVENT]), head, msgpack.packb([b"\x01"])]) == "bad_msgpack"
    assert reason(batch_of()) == "bad_field"  # no messages
    assert reason(batch_of(ok, bodies=[b"\x01", b"\x02"])) == "bad_body"  # counts differ


def test_a_frame_with_no_bad_message_decodes_as_before():
    msgs = [env(1, headers={"sb-order": "s1", "trace": {"a": b"x"}}), env(2, expires=YEAR_10000 - 1)]
    frame = roundtrip(P.encode_batch(Kind.EVENT, "n", ADDR, msgs, sent_at=YEAR_10000 - 1))
    assert frame.messages == tuple(msgs) and frame.invalid == () and frame.undecodable == ()


def test_random_junk_in_a_batch_header_sets_apart_what_it_can_and_never_escapes():
    import random
    rng = random.Random(11)
    msgs = [env(i, headers={"sb-order": "s1", "k": {"a": [i]}}, correlation_id=f"c{i}") for i in range(5)]
    good = P.encode_batch(Kind.EVENT, "n", ADDR, msgs)
    apart = 0
    for _ in range(3000):
        header = bytearray(good[2])
        for _ in range(rng.randint(1, 3)):
            header[rng.randrange(len(header))] = rng.randrange(256)
        try:
            frame = decode([good[0], good[1], bytes(header), good[3]], max_payload=LIMIT)
        except ProtocolError:
            continue
        # Every message is accounted for, once: handled, too large, undecodable or invalid.
        ids = [m.id for m in frame.messages] + list(frame.oversize) + [
            e.id for e, _ in frame.undecodable] + [m.id for m in frame.invalid]
        assert len(ids) == 5 and all(type(i) is str and 0 < len(i) <= 64 for i in ids)
        apart += len(frame.invalid)
    assert apart > 100  # most junk lands in one message's fields
