"""The step floor: the train state, the one loss assembly, the strategies that own the microbatch loop
(the scan, or the pipeline under mesh.pp > 1), the optimizer and the jitted step."""
