"""The kernel log as a source of XIDs, shaped like node-problem-detector's kernel monitor.

Why a package: reading the kernel log is four jobs that change for different reasons, and
node-problem-detector's kernel monitor already keeps them apart (one log watcher per input behind
one interface, a pure problem matcher, a thin monitor that wires them). Here:

- ``formats``: the record formats (``/dev/kmsg``, dmesg, ``journalctl -k``, syslog) taken apart;
- ``parser``: kernel-log lines to ``XidEvent``s (XID, SXid, fallen off the bus, a GPU that failed
  to initialise); pure, no I/O; ``repeats``: a storm of one XID folded into a few events that carry
  its count;
- ``reader``: the one interface every input's reader has; ``device_reader`` (``/dev/kmsg``),
  ``file_reader`` (a followed file) and ``ring_reader`` (the ring through ``syslog(2)``, with
  ``klogctl`` the system call and ``ring`` the telling of new lines from old ones);
- ``cursor``: where reading stopped, saved across restarts; ``boot``: the host's boot time;
- ``wording``: every sentence an operator reads about an input that cannot be read;
- ``source``: ``KmsgSource``, what the loop schedules: picks the reader, feeds the parser, keeps
  the cursor and the error tally; ``offline``: the parser over finished text (``classify``).

Nothing is imported here, so importing one module costs only that module.
"""
