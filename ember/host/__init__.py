"""Facts about the host and where ember keeps its files: CPU and ISA detection (`isa`), cache
directories (`dirs`), weight memory, huge pages and heap trimming (`memory`). No ember imports
outside this package: every layer may use it."""
