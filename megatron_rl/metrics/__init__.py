"""Run metrics: what is measured each step (`step`), where it goes (`logger`), pictures of a run (`plots`)."""
