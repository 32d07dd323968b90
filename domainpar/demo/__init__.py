"""`domainpar demo`: the main job, end to end.

A Gray-Scott solver in a periodic 3-D box run domain-parallel with domainpar's
halo exchange (``grayscott``) makes trajectories, written to HDF5 by every
rank in parallel (``dataset``); a 3-D UNet surrogate trains domain-parallel on
them (``surrogate``), is checked against one process on a crop (``check``)
and drawn (``plots``). ``job`` runs the stages, ``cli`` parses the options.
"""
