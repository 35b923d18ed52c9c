"""Aether: dsec's binary, multiplexed, CRC-checked wire protocol (see docs/aether.md)."""

from dsec.aether.connection import (
    AetherProtocol,
    CallStream,
    Connection,
    DuplexStream,
    Router,
    StreamSender,
    after_reply_written,
    current_peer,
)
from dsec.aether.frame import Frame, FrameDecoder, FrameFlags, FrameType, decode_parts, encode
from dsec.aether.transport import Address, Server, connect, parse_address, serve

__all__ = [
    "Address", "AetherProtocol", "CallStream", "Connection", "DuplexStream", "Frame", "FrameDecoder", "FrameFlags", "FrameType",
    "Router", "Server", "StreamSender", "after_reply_written", "connect", "current_peer",
    "decode_parts", "encode",
    "parse_address", "serve",
]
