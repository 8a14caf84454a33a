"""The ``areal-ckpt`` command line: argument parsing and printing only; what it runs lives in
:mod:`areal_ckpt.tools` (each location through :func:`areal_ckpt.tools.places.place_of`)."""
