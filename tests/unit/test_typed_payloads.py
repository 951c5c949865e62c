"""Typed payloads (issue 29): what services send (datetime, Decimal, UUID, enums,
dataclasses, msgspec Structs, pydantic models) goes out as plain msgpack that every receiver
decodes, and a handler whose payload parameter is annotated with a model gets it validated,
or the message is a dead letter ``invalid``. On the test doubles here; across processes in
tests/integration/test_typed.py."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import decimal
import enum
import uuid

import msgpack
import msgspec
import pydantic
import pytest

from servicebus import InvalidPayload, Message, Reject
from servicebus.model.packer import pack
from servicebus.testing import AsyncStubBus, StubBus
from servicebus.wire.payload import decode_payload, encode_payload

NOW = dt.datetime(2024, 5, 1, 12, 30, tzinfo=dt.timezone.utc)
ORDER_ID = uuid.UUID("12345678-1234-5678-1234-567812345678")


class Status(enum.Enum):
    NEW = "new"
    PAID = "paid"


class Line(msgspec.Struct):
    sku: str
    qty: int
    price: decimal.Decimal


class Order(msgspec.Struct):
    id: uuid.UUID
    status: Status
    lines: list[Line]
    created: dt.datetime
    ship_by: dt.date
    note: bytes = b""


@dataclasses.dataclass
class OrderDC:
    id: uuid.UUID
    status: Status
    total: decimal.Decimal
    created: dt.datetime


class OrderModel(pydantic.BaseModel):
    id: uuid.UUID
    status: Status
    total: decimal.Decimal
    created: dt.datetime


def an_order(**changes) -> Order:
    order = Order(ORDER_ID, Status.NEW, [Line("A-1", 2, decimal.Decimal("9.99"))], NOW,
                  dt.date(2024, 5, 3), b"\x00\xff")
    return msgspec.structs.replace(order, **changes)


PLAIN = {"id": str(ORDER_ID), "status": "new", "total": "19.98", "created": "2024-05-01T12:30:00Z"}


# --- the serializer ------------------------------------------------------------------------

@pytest.mark.parametrize("value, plain", [
    (NOW, "2024-05-01T12:30:00Z"),
    (dt.date(2024, 5, 3), "2024-05-03"),
    (decimal.Decimal("142.48"), "142.48"),
    (ORDER_ID, str(ORDER_ID)),
    (Status.PAID, "paid"),
    ({"at": [NOW]}, {"at": ["2024-05-01T12:30:00Z"]}),
])
def test_datetimes_decimals_uuids_and_enums_are_sent_as_the_plain_values_every_receiver_decodes(value, plain):
    body = encode_payload(value)
    assert msgpack.unpackb(body, raw=False) == plain  # any msgpack reader, no hook
    assert decode_payload(body) == plain


@pytest.mark.parametrize("value", [
    an_order(), OrderDC(ORDER_ID, Status.NEW, decimal.Decimal("19.98"), NOW),
    OrderModel(id=ORDER_ID, status=Status.NEW, total=decimal.Decimal("19.98"), created=NOW),
])
def test_structs_dataclasses_and_pydantic_models_are_sent_as_maps_of_plain_values(value):
    decoded = decode_payload(encode_payload(value))
    assert isinstance(decoded, dict) and decoded["id"] == str(ORDER_ID) and decoded["status"] == "new"
    assert pack(decoded) == encode_payload(value)  # nothing but plain msgpack in it


def test_bytes_in_a_struct_stay_bytes_on_the_wire():
    assert decode_payload(encode_payload(an_order()))["note"] == b"\x00\xff"


def test_plain_payloads_encode_exactly_as_before():
    payload = {"n": 1, "items": [1.5, "x", b"y", None, True]}
    assert encode_payload(payload) == pack(payload)


@pytest.mark.parametrize("payload, where", [
    ({"x": {1, 2}}, r'payload\["x"\]: a set cannot be encoded with msgpack'),
    ({"when": [NOW, object()]}, r'payload\["when"\]\[1\]: an object cannot be encoded'),
    ({"lock": OrderDC(ORDER_ID, Status.NEW, decimal.Decimal(1), object())},  # type: ignore[arg-type]
     r'payload\["lock"\]: an OrderDC cannot be encoded: .*object'),
])
def test_what_no_receiver_could_decode_is_still_refused_saying_where(payload, where):
    with pytest.raises(TypeError, match=where):
        encode_payload(payload)


# --- typed handlers on the stubs -------------------------------------------------------------

def test_a_handler_annotated_with_a_struct_gets_a_validated_instance():
    stub, got = StubBus(), []

    @stub.every("orders.placed")
    def placed(order: Order, message: Message) -> None:
        got.append(order)

    stub.publish("orders.placed", an_order())
    assert stub.drain()
    assert got == [an_order()] and type(got[0].lines[0].price) is decimal.Decimal


def test_a_handler_annotated_with_a_dataclass_or_a_pydantic_model_gets_an_instance():
    stub, got = StubBus(), []
    stub.every("orders.dc", lambda o, m: got.append(o))  # untyped: the plain map

    @stub.every("orders.dc", name="typed_dc")
    def as_dataclass(order: OrderDC, message):
        got.append(order)

    @stub.handle("orders.model")
    def as_model(order: OrderModel, message):
        got.append(order)

    stub.publish("orders.dc", PLAIN)
    stub.send(stub.address, "orders.model", OrderModel.model_validate(PLAIN))
    assert stub.drain()
    assert got[0] == {**PLAIN, "total": "19.98"}
    assert got[1] == OrderDC(ORDER_ID, Status.NEW, decimal.Decimal("19.98"), NOW)
    assert got[2] == OrderModel(id=ORDER_ID, status=Status.NEW, total=decimal.Decimal("19.98"), created=NOW)


def test_a_payload_that_does_not_validate_is_a_dead_letter_invalid_at_once_with_the_validation_error():
    stub, runs = StubBus(max_attempts=5), []

    @stub.every("orders.placed")
    def placed(order: Order, message: Message) -> None:
        runs.append(order)

    stub.publish("orders.placed", {"id": "not a uuid"})
    assert stub.drain()
    (letter,) = stub.deadletters()
    assert runs == [] and (letter.reason, letter.attempts) == ("invalid", 1)
    assert "ValidationError" in letter.error and "uuid" in letter.error.lower()


def test_invalid_payload_is_a_reject_a_handler_may_raise_itself():
    assert issubclass(InvalidPayload, Reject)
    stub = StubBus()

    @stub.every("orders.placed")
    def placed(payload, message):
        raise InvalidPayload("qty must be positive")

    stub.publish("orders.placed", {"qty": -1})
    stub.drain()
    assert [(d.reason, d.error) for d in stub.deadletters()] == [("invalid", "qty must be positive")]


def test_a_typed_request_handler_replies_to_an_instance_and_an_invalid_request_raises_remote_error():
    stub = StubBus()

    @stub.handle("orders.total")
    def total(order: OrderModel, message) -> str:
        return str(order.total * 2)

    assert stub.request(stub.address, "orders.total", PLAIN) == "39.96"
    with pytest.raises(Exception, match="InvalidPayload"):
        stub.request(stub.address, "orders.total", {"id": 1})


def test_the_async_stub_gives_an_async_def_handler_a_validated_instance():
    got = []

    async def main():
        bus = AsyncStubBus()

        @bus.every("orders.placed")
        async def placed(order: Order, message: Message) -> None:
            got.append(order)

        await bus.publish("orders.placed", an_order())
        await bus.publish("orders.placed", {"id": 1})
        await bus.drain()
        return await bus.deadletters()

    letters = asyncio.run(main())
    assert got == [an_order()] and [d.reason for d in letters] == ["invalid"]



def _local_models() -> tuple[type, type]:
    # Under ``from __future__ import annotations`` a field typed with a class local to a
    # function is a name nothing can resolve later.
    class Part(msgspec.Struct):
        sku: str

    class Kit(msgspec.Struct):
        part: Part

    @dataclasses.dataclass
    class Box:
        part: Part

    return Kit, Box


@pytest.mark.parametrize("model", _local_models())
def test_a_model_whose_field_types_cannot_be_resolved_is_refused_at_registration_not_per_message(model):
    stub = StubBus()

    def handle(payload, message):
        return None

    handle.__annotations__["payload"] = model
    with pytest.raises(TypeError, match=rf"{model.__name__}.*name 'Part' is not defined"):
        stub.every("kits.made", handle)
    stub.publish("kits.made", {"part": {"sku": "a"}})
    assert stub.deadletters() == []  # nothing was ever dead-lettered "invalid" for it


def test_a_failure_to_convert_that_is_not_the_payloads_fault_is_retried_not_invalid():
    class Odd(msgspec.Struct):
        n: int

        def __post_init__(self) -> None:
            if self.n == 2:
                raise RuntimeError("a bug in the model, not a bad payload")

    stub = StubBus(max_attempts=2)
    seen = []

    def handle(payload: Odd, message: Message) -> None:
        seen.append(payload.n)

    handle.__annotations__["payload"] = Odd
    stub.every("odd", handle)
    stub.publish("odd", {"n": 1})
    stub.publish("odd", {"n": 2})
    stub.drain()
    stub.advance(60)
    stub.drain()
    assert seen == [1]
    assert [(d.reason, d.attempts) for d in stub.deadletters()] == [("handler_failed", 2)]


def test_a_pydantic_model_with_aliases_and_computed_fields_survives_the_round_trip():
    class Aliased(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        order_id: int = pydantic.Field(alias="orderId")

        @pydantic.computed_field  # type: ignore[prop-decorator]
        @property
        def double(self) -> int:
            return self.order_id * 2

    stub = StubBus()
    got = []

    def handle(order, message):
        got.append(order)

    handle.__annotations__["order"] = Aliased
    stub.every("orders", handle)
    stub.publish("orders", Aliased(orderId=7))
    assert stub.drain() and [o.order_id for o in got] == [7] and stub.deadletters() == []
