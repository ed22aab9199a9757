"""Everything between processes: the process group and a bounded rendezvous, every collective, the check that all ranks train one config, and torchrun with one-line failures."""
