"""Measurement: what runs the runtime to check or feed the estimator. `calibrate` micro-profiles this
device (kernels, collectives, the runtime's wrappers) into the estimator's stored calibration;
`validate` compares the estimator's predictions with measured training steps."""
