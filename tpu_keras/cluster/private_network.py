"""A private network for a simulated pod: its servers reachable from inside it alone.

Why: the servers a multi-host run starts (TensorFlow's worker gRPC servers,
the JAX coordinator, the tf.data service's dispatcher and worker) do not
authenticate. Whoever reaches one of their ports can run graphs in that
process, which means reading and writing files as the user who trains;
TensorFlow's maintainers say the servers are meant for private networks
(tensorflow/tensorflow#11689). And they listen on every interface, whatever
host the cluster's addresses name. On a pod the VPC is that private network.
On a laptop or a shared server, `python -m tpu_keras.launch` makes one.

How: Linux lets an unprivileged process create a user namespace and, in it, a
network namespace holding nothing but a loopback interface (what `unshare
-rn` does). `enter()` moves the calling process into a new pair, maps the
user's own uid and gid to themselves (files are written as before), and
brings `lo` up. Every process it starts afterwards inherits the namespace:
they reach one another on 127.0.0.1, nothing outside reaches them, and they
reach nothing outside.

`unshare(CLONE_NEWUSER)` needs a single-threaded process and cannot be
undone, so `enter()` first makes the whole change in a forked child, and
changes this process only once that has worked. Where the kernel refuses (no
unprivileged user namespaces, a container that forbids them),
`Unavailable` says why and nothing has changed. Python 3.12's `os.unshare`
would do; ctypes serves 3.11.
"""

import ctypes
import fcntl
import os
import socket
import struct
import sys

from tpu_keras.errors import UserError

CLONE_NEWUSER = 0x10000000  # <linux/sched.h>
CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS = 0x8913, 0x8914  # <linux/sockios.h>
_IFF_UP, _IFF_RUNNING = 0x1, 0x40  # <net/if.h>


class Unavailable(Exception):
    """The kernel refused a private network; the message says which step and why."""


def enter() -> None:
    """Moves this process (and so all it starts later) into a private network.

    Raises `Unavailable` (and changes nothing) where the kernel refuses, and a
    `UserError` in the unlikely case that it refuses this process what it
    allowed the trial child a moment before.
    """
    if not sys.platform.startswith("linux"):
        raise Unavailable(f"network namespaces are Linux's, and this is {sys.platform}")
    if len(os.listdir("/proc/self/task")) > 1:
        raise Unavailable("this process runs several threads, and unshare needs just one")
    refused = _in_forked_child(_isolate)
    if refused:
        raise Unavailable(refused)
    try:
        _isolate()
    except OSError as error:
        raise UserError(f"could not make a private network ({error}) although a trial just "
                        "did; run with --network=host") from None


def _isolate() -> None:
    uid, gid = os.getuid(), os.getgid()
    _unshare(CLONE_NEWUSER | CLONE_NEWNET)
    _write("/proc/self/setgroups", "deny")  # the kernel's condition for writing gid_map unprivileged
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")
    _bring_up_loopback()


def _unshare(flags: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(flags) != 0:
        number = ctypes.get_errno()
        raise OSError(number, f"unshare: {os.strerror(number)}")


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w") as file:
            file.write(text)
    except OSError as error:
        raise OSError(error.errno, f"writing {path}: {error.strerror}") from None


def _bring_up_loopback() -> None:
    """`ip link set lo up`, as one ioctl on any socket of the namespace."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sh22x", b"lo", 0)  # struct ifreq: name, then ifr_flags
        try:
            flags = struct.unpack("16sh22x", fcntl.ioctl(sock, _SIOCGIFFLAGS, request))[1]
            fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sh22x", b"lo",
                                                         flags | _IFF_UP | _IFF_RUNNING))
        except OSError as error:
            raise OSError(error.errno, f"bringing up lo: {error.strerror}") from None


def _in_forked_child(step) -> str:
    """Runs `step()` in a forked child; returns '' if it worked, else why not."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, and exit without running any of the parent's cleanup
        message = ""
        try:
            step()
        except OSError as error:
            message = error.strerror or str(error)
        except BaseException as error:  # pylint: disable=broad-except  # reported, not raised
            message = f"{type(error).__name__}: {error}"
        os.write(write_end, message.encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        message = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    if not message and status != 0:
        message = f"the trial child ended with status {status}"
    return message
