"""FAKE ray: ``ray.remote(**opts)`` returns the class unchanged, marked."""


def remote(*args, **kwargs):
    def wrap(cls):
        cls._fake_ray_remote_options = kwargs
        return cls
    if args and callable(args[0]) and not kwargs:
        return wrap(args[0])
    return wrap
