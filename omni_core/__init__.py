"""omni_core: the library behind omni (recipes, data, models, runtime, tracking). Never imports Prefect."""
