"""The command line: the one ``steptap`` command (``main.py``; ``python -m steptap.middleware.cli`` runs it)
and the flags generated from a config Struct (``flags.py``). Part of the kernel: it imports no other room (the
commands are imported by name, when one runs), and the learner's flags come from here too."""
