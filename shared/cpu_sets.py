"""Sets of CPU cores as text (``0-3,8``), and how several workers share a machine's cores.

``--cpu-omp-threads-bind`` (vLLM's ``VLLM_CPU_OMP_THREADS_BIND``) names the cores a worker's
threads run on: ``auto`` or ``nobind`` (every core it may use), a list such as ``0-3,8``,
or one list per TP rank separated by ``|`` (rank r takes entry r). The worker applies it
(``services/worker/cpu_binding.py``); the launcher gives each of its workers a share
(``split_cores``).
"""

from __future__ import annotations

UNBOUND = ("auto", "nobind", "")


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,8"`` -> [0, 1, 2, 3, 8]; ValueError naming the bad part otherwise."""
    cpus: list[int] = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()) or int(last or first) < int(first):
            raise ValueError(f"{part!r} is no core or core range (e.g. 0-3,8)")
        cpus.extend(range(int(first), int(last or first) + 1))
    return sorted(set(cpus))


def format_cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 3, 8] -> ``"0-3,8"``."""
    parts: list[str] = []
    for cpu in sorted(cpus):
        if parts and cpu == last + 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{cpu}"
        else:
            parts.append(str(cpu))
        last = cpu
    return ",".join(parts)


def cores_for_rank(bind: str, rank: int) -> list[int] | None:
    """The cores ``bind`` gives TP rank ``rank`` (None: no binding); ValueError if none."""
    if bind.strip().lower() in UNBOUND:
        return None
    entries = bind.split("|")
    if len(entries) > 1 and rank >= len(entries):
        raise ValueError(f"{bind!r} has {len(entries)} entries, none for rank {rank}")
    return parse_cpu_list(entries[rank] if len(entries) > 1 else entries[0])


def check_bind(bind: str) -> None:
    """ValueError unless ``bind`` is auto, nobind or core lists."""
    if bind.strip().lower() not in UNBOUND:
        for entry in bind.split("|"):
            parse_cpu_list(entry)


def split_cores(cores: list[int], num_workers: int) -> list[list[int]]:
    """Each of ``num_workers`` workers' cores: contiguous, as even as can be (the first get
    one more); with fewer cores than workers, worker i shares core ``i % len(cores)``."""
    cores = sorted(cores)
    if num_workers > len(cores):
        return [[cores[i % len(cores)]] for i in range(num_workers)]
    size, extra = divmod(len(cores), num_workers)
    shares, start = [], 0
    for i in range(num_workers):
        end = start + size + (i < extra)
        shares.append(cores[start:end])
        start = end
    return shares
