from dsec.aether.frame import Frame, FrameDecoder, FrameType, encode


def test_encode_decode_roundtrip() -> None:
    f = Frame(FrameType.REQUEST, 1, b"\x04ping\xc0")
    dec = FrameDecoder()
    dec.feed(encode(f))
    assert dec.next_frame() == f
    assert dec.next_frame() is None
