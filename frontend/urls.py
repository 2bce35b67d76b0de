from django.contrib.auth import views as auth_views
from django.urls import path

from frontend import views

app_name = "frontend"
urlpatterns = [
    path("", views.home, name="home"),
    path("login/", auth_views.LoginView.as_view(redirect_authenticated_user=True), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
]
