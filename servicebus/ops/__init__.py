"""Operations: the ``servicebus`` command line, admin views of a data directory (live or
stopped), check and repair, offline maintenance. Offline tools never start a bus."""
