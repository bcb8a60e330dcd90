"""Measurement: what runs the runtime to check or feed the estimator. `calibrate` micro-profiles this
device (kernels, collectives, the runtime's wrappers) into the estimator's stored calibration;
`validate` compares the estimator's predictions with measured training steps.

    calibrate            the calibration: runs the probes, stores the result per device type
    probe_device         where the kernel probes run and at what shapes (CPU_PROBES, CUDA_PROBES)
    sampling             interleaved timing of probes, least-squares fits, aten operator counts
    kernels              the kernel probes (matmul, attention, operators, element-wise, optimizer, memory)
    block_probes         probes built from the model's transformer block (operator overhead, element-wise work)
    parameter_probes     the optimizer's update over few and many parameters, plain or DTensors
    collective_probes    the collectives at several sizes (gloo or NCCL), their share of a core
    wrapper_probes       what FSDP2, TP and a 1F1B pipeline add per forward + backward
    rank_probes          the ranks probe: collectives, wrappers, memory sharing and straggling on forked ranks
    measured_efficiency  measurements -> the catalogue entry and Efficiency the cost model prices with
    validate             the validation's rounds, and stored reports predicted again
    cases                the validation's cases and the recipe of each
    case_runs            a world size's cases run and timed on the real runtime
    case_prediction      the cost model's prediction for a case
    validation_report    predicted against measured: the report and its figure
"""
