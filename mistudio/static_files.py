"""WhiteNoise's middleware, able to run in Daphne's event loop.

WhiteNoise's own middleware is sync-only. One sync-only middleware in an otherwise async chain
makes Django switch threads around it on every request (event loop → thread → event loop → the
view's thread): measured at several milliseconds per API call on two cores. This subclass serves
static files exactly as WhiteNoise does and, for everything else, awaits the rest of the chain,
so a request crosses to a thread once, for the view.

The static files the apps hold are looked up once per process (WhiteNoise looks them up, and
stats each, whenever a middleware chain is built: once per process in production, but once per
test client in the tests, where it was 38 ms of every client's first request).
"""

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.conf import settings
from whitenoise.middleware import WhiteNoiseMiddleware

# What the finders found, by static prefix and the places they look (the apps and static dirs).
_FOUND: dict[tuple, dict] = {}


class StaticFilesMiddleware(WhiteNoiseMiddleware):
    sync_capable = True
    async_capable = True

    def add_files_from_finders(self):
        key = (self.static_prefix, tuple(settings.INSTALLED_APPS), tuple(map(str, settings.STATICFILES_DIRS)))
        if key not in _FOUND:
            before = dict(self.files)
            super().add_files_from_finders()
            _FOUND[key] = {url: found for url, found in self.files.items() if before.get(url) is not found}
        self.files.update(_FOUND[key])

    def __init__(self, get_response=None, settings=settings):
        super().__init__(get_response, settings)
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request):
        if self.is_async:
            return self.__acall__(request)
        return super().__call__(request)

    async def __acall__(self, request):
        if self.autorefresh:  # development: the file system is searched per request, off the loop
            static_file = await sync_to_async(self.find_file)(request.path_info)
        else:
            static_file = self.files.get(request.path_info)
        if static_file is not None:
            return await sync_to_async(self.serve)(static_file, request)
        return await self.get_response(request)
