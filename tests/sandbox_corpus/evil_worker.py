"""A compromised sandbox worker: speaks the protocol, then misbehaves (tests only).

Usage: evil_worker.py MODE --in FD --out FD [ignored pool options...]
MODE: drip (slow-drip output), flood (claims a huge payload), garbage (bytes that are not
Arrow), header (an oversized header), zstd (compressed Arrow), die (exits mid-reply), silent
(never answers), dictbomb (a dictionary that decodes to 50 GB), liar (claims OS layers it
never applied, with a second thread running).
"""

import json
import os
import struct
import sys
import time


def main() -> None:
    mode = sys.argv[1]
    args = sys.argv[2:]
    rfd = int(args[args.index("--in") + 1])
    wfd = int(args[args.index("--out") + 1])

    def send(header: dict, payload: bytes = b"", claimed: int | None = None) -> None:
        head = json.dumps(header).encode()
        size = len(payload) if claimed is None else claimed
        os.write(wfd, struct.pack("<II", len(head), size) + head)
        if payload:
            os.write(wfd, payload)

    def read_exact(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = os.read(rfd, n - len(buf))
            if not chunk:
                sys.exit(0)
            buf += chunk
        return buf

    if mode == "zstd":  # made before "ready": a loaded machine must not turn it into a timeout
        import pyarrow as pa

        table = pa.table({"x": pa.array([0] * 100_000)})
        sink = pa.BufferOutputStream()
        opts = pa.ipc.IpcWriteOptions(compression="zstd")
        with pa.ipc.new_stream(sink, table.schema, options=opts) as w:
            w.write_table(table)
        zstd = sink.getvalue().to_pybytes()
    if mode == "dictbomb":  # 600 KB of Arrow IPC that decodes to 50 GB
        import pyarrow as pa

        idx = pa.Array.from_buffers(pa.int8(), 100_000, [None, pa.py_buffer(bytes(100_000))])
        bomb = pa.DictionaryArray.from_arrays(idx, pa.array([b"x" * (512 << 10)]))
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, pa.schema([("bomb", bomb.type)])) as w:
            w.write_table(pa.table({"bomb": bomb}))
        dictbomb = sink.getvalue().to_pybytes()
    if mode == "liar":
        import threading

        threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
        claimed = dict.fromkeys(("network_namespace", "seccomp", "drop_privileges"), "active")
        send({"status": "ready", "layers": claimed, "pid": os.getpid()})
    else:
        send({"status": "ready", "layers": {"evil": "active"}, "pid": os.getpid()})
    while True:
        hlen, plen = struct.unpack("<II", read_exact(8))
        read_exact(hlen + plen)
        if mode == "drip":
            send({"status": "ok", "rows": 1}, claimed=4096)
            for _ in range(4096):
                os.write(wfd, b"\x00")
                time.sleep(0.05)
        elif mode == "flood":
            send({"status": "ok", "rows": 1}, claimed=(1 << 32) - 1)
            chunk = b"\xff" * (1 << 16)
            while True:
                os.write(wfd, chunk)
        elif mode == "garbage":
            send({"status": "ok", "rows": 3}, os.urandom(1000))
        elif mode == "header":
            os.write(wfd, struct.pack("<II", (1 << 31), 0))
            time.sleep(60)
        elif mode == "die":
            send({"status": "ok", "rows": 1}, claimed=100)
            os._exit(3)
        elif mode == "zstd":  # valid Arrow, but compressed: a decompression bomb in the making
            send({"status": "ok", "rows": 1}, zstd)
        elif mode == "dictbomb":
            send({"status": "ok", "rows": 100_000}, dictbomb)
        elif mode == "silent":
            time.sleep(600)


if __name__ == "__main__":
    main()
