"""The records the layers pass to each other: public records, stored layouts, delivery
state, ids, clocks, configuration, dead letters. No I/O."""
