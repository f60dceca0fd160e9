"""A producer that can write what confluent-kafka's Python API cannot: header names that are not UTF-8.

confluent-kafka takes header names as ``str``; librdkafka's C API takes any bytes. Real clients (Java, Go,
C) write such headers, and kinference must survive them. This drives the librdkafka that ships inside the
confluent-kafka wheel through ctypes: ``rd_kafka_produceva`` takes an array instead of varargs.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import confluent_kafka

# rd_kafka_vtype_t
_END, _TOPIC, _PARTITION, _VALUE, _KEY, _HEADER = 0, 1, 3, 4, 5, 9
_PRODUCER = 0
_MSG_F_COPY = 0x2


class _Header(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("val", ctypes.c_void_p), ("size", ctypes.c_ssize_t)]


class _Mem(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_void_p), ("size", ctypes.c_size_t)]


class _Union(ctypes.Union):
    _fields_ = [("cstr", ctypes.c_char_p), ("i32", ctypes.c_int32), ("mem", _Mem), ("header", _Header),
                ("_pad", ctypes.c_char * 64)]


class _Vu(ctypes.Structure):
    """rd_kafka_vu_t"""

    _fields_ = [("vtype", ctypes.c_int), ("u", _Union)]


def _library() -> ctypes.CDLL:
    libs = Path(confluent_kafka.__file__).parent.parent / "confluent_kafka.libs"
    (path,) = libs.glob("librdkafka*.so*")
    lib = ctypes.CDLL(str(path))
    lib.rd_kafka_conf_new.restype = ctypes.c_void_p
    lib.rd_kafka_conf_set.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                                      ctypes.c_size_t]
    lib.rd_kafka_new.restype = ctypes.c_void_p
    lib.rd_kafka_new.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.rd_kafka_produceva.restype = ctypes.c_void_p
    lib.rd_kafka_produceva.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Vu), ctypes.c_size_t]
    lib.rd_kafka_error_string.restype = ctypes.c_char_p
    lib.rd_kafka_error_string.argtypes = [ctypes.c_void_p]
    lib.rd_kafka_flush.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.rd_kafka_outq_len.argtypes = [ctypes.c_void_p]
    lib.rd_kafka_destroy.argtypes = [ctypes.c_void_p]
    return lib


def _fill(vu: _Vu, slot: str, data: Any) -> list[Any]:
    """Set one ``rd_kafka_vu_t``'s value; returns the buffers it points into."""
    if slot == "cstr":
        vu.u.cstr = data
        return []
    if slot == "i32":
        vu.u.i32 = data
        return []
    if slot == "mem":
        buffer = ctypes.create_string_buffer(data, len(data))
        vu.u.mem = _Mem(ctypes.cast(buffer, ctypes.c_void_p), len(data))
        return [buffer]
    name, header_value = data  # a NUL-terminated name: any bytes but NUL
    value_buffer = ctypes.create_string_buffer(header_value, len(header_value))
    vu.u.header = _Header(name, ctypes.cast(value_buffer, ctypes.c_void_p), len(header_value))
    return [name, value_buffer]


def produce_raw(bootstrap_servers: str, topic: str, partition: int,
                records: list[tuple[bytes | None, bytes | None, list[tuple[bytes, bytes]]]]) -> None:
    """Produce ``(key, value, [(header name bytes, header value bytes)])`` records, in order, to one partition
    (one record per batch), and wait until all are delivered."""
    lib = _library()
    error = ctypes.create_string_buffer(512)
    conf = lib.rd_kafka_conf_new()
    for name, value in (("bootstrap.servers", bootstrap_servers), ("linger.ms", "0"), ("batch.num.messages", "1"),
                        ("enable.idempotence", "true")):
        if lib.rd_kafka_conf_set(conf, name.encode(), value.encode(), error, len(error)) != 0:
            raise RuntimeError(error.value.decode())
    producer = lib.rd_kafka_new(_PRODUCER, conf, error, len(error))
    if not producer:
        raise RuntimeError(error.value.decode())
    try:
        for key, value, headers in records:
            fields = [(_TOPIC, "cstr", topic.encode()), (_PARTITION, "i32", partition)]
            if key is not None:
                fields.append((_KEY, "mem", key))
            if value is not None:
                fields.append((_VALUE, "mem", value))
            fields += [(_HEADER, "header", header) for header in headers]
            vus = (_Vu * (len(fields) + 1))()
            keep = []  # the buffers must outlive the call (librdkafka copies them: RD_KAFKA_MSG_F_COPY)
            for i, (vtype, slot, data) in enumerate(fields):
                vus[i].vtype = vtype
                keep += _fill(vus[i], slot, data)
            vus[len(fields)].vtype = _END
            failure = lib.rd_kafka_produceva(producer, vus, len(fields))
            if failure:
                raise RuntimeError(lib.rd_kafka_error_string(failure).decode())
            lib.rd_kafka_flush(producer, 10_000)  # one at a time: the order on the partition is the list's order
        if lib.rd_kafka_outq_len(producer) != 0:
            raise RuntimeError("records were not delivered within 10 s")
    finally:
        lib.rd_kafka_destroy(producer)
